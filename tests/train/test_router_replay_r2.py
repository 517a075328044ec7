"""R2 (the trainer replays its own old-pass routes) on a real tiny Qwen3-MoE: routes recorded in the step's
old pass drive every later forward even after the router moved, the router still gets gradient, a PPO step
replays the old pass's routes in every update, and r2 on a dense model is refused with the reason."""

from pathlib import Path

import numpy as np
import pytest
import torch

from tandem.core.config import TrainConfig, load_config
from tandem.core.errors import ConfigError
from tandem.core.records import Group, Reward, SegmentBuilder, Trajectory
from tandem.model.moe import routers, write_model_dir
from tandem.train.batching import SequenceInput, pack, token_logprobs
from tandem.train.trainer import Trainer

BASE = Path(__file__).resolve().parents[2] / "models" / "tandem-base"


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return str(write_model_dir(tmp_path_factory.mktemp("moe"), "moe", tokenizer_dir=BASE, seed=0))


def _groups(n_groups: int = 2, seed: int = 0) -> list[Group]:
    """Groups of two trajectories (rewards 0 and 1) with random prompts and sampled tokens, no routes."""
    rng = np.random.default_rng(seed)
    groups = []
    for gi in range(n_groups):
        trajs = []
        for r in (0.0, 1.0):
            b = SegmentBuilder()
            b.add_context(rng.integers(10, 4000, 12).tolist())
            b.add_sampled(rng.integers(10, 4000, 8).tolist(), [-8.0] * 8, [0] * 8)
            trajs.append(Trajectory(f"g{gi}", [b.build()], Reward(r)))
        groups.append(Group(f"g{gi}", trajs))
    return groups


def _config(**kw):
    base = dict(lr=1e-2, micro_batch_tokens=64, seed=0, threads=1, router_replay="r2")
    base.update(kw)
    return TrainConfig(**base)


def _perturb_routers(model, scale: float = 3.0) -> None:
    with torch.no_grad():
        gen = torch.Generator().manual_seed(1)
        for g in routers(model):
            g.weight.add_(torch.randn(g.weight.shape, generator=gen) * g.weight.std() * scale)


def _row(groups):
    return pack([SequenceInput(t.segments[0], 1.0) for g in groups for t in g.trajectories], 1000)[0]


def test_routes_of_the_old_pass_are_replayed_after_the_router_moved(moe_dir):
    trainer = Trainer(moe_dir, _config())
    hooks = trainer.routing.hooks
    mb = _row(_groups())
    trainer.routing.begin_step()
    with torch.no_grad():
        old = trainer._logprobs(mb, False, None, old=True).logprobs
        recorded = trainer.routing.recorded(mb).clone()
        assert torch.equal(old, token_logprobs(trainer.model, mb).logprobs)  # the old pass replays nothing
        _perturb_routers(trainer.model)
        hooks.clear()
        own = token_logprobs(trainer.model, mb).logprobs  # the moved router's own choice
        own_routes = hooks.own()
        later = trainer._logprobs(mb, False, None).logprobs  # R2: the recorded routes
        # the first MoE layer still sees the moved router's own choice (later layers' inputs depend on the
        # replayed experts of the layers before them)
        assert torch.equal(hooks.own()[:, 0], own_routes[:, 0])
        hooks.replay = recorded
        try:
            forced = token_logprobs(trainer.model, mb).logprobs
        finally:
            hooks.replay = None
    assert not torch.equal(own_routes, recorded)  # the perturbation did change the routing
    assert torch.equal(later, forced)
    assert not torch.allclose(later, own)
    # a new step forgets the records: a forward without an old pass is refused instead of guessing
    trainer.routing.begin_step()
    with pytest.raises(RuntimeError, match="no old-pass forward"):
        trainer._logprobs(mb, False, None)


def test_r2_gradient_reaches_the_router(moe_dir):
    trainer = Trainer(moe_dir, _config())
    mb = _row(_groups())
    trainer.routing.begin_step()
    with torch.no_grad():
        trainer._logprobs(mb, False, None, old=True)
    _perturb_routers(trainer.model)
    out = trainer._logprobs(mb, False, None).logprobs
    (out * mb.loss_mask).sum().backward()
    gates = routers(trainer.model)
    assert all(g.weight.grad is not None and float(g.weight.grad.abs().sum()) > 0 for g in gates)


def _used_routes(trainer) -> list[torch.Tensor]:
    """Record the expert ids every router actually used (after any replay), one [N, layers, k] per forward."""
    gates = routers(trainer.model)
    per_layer: list[torch.Tensor] = []
    forwards: list[torch.Tensor] = []

    def hook(layer):
        def fn(module, args, output):
            per_layer.append(output[2].detach().clone())
            if layer == len(gates) - 1:
                forwards.append(torch.stack(per_layer, 1))
                per_layer.clear()

        return fn

    for i, g in enumerate(gates):  # registered after TrainerRouting's hooks: sees the replayed indices
        g.register_forward_hook(hook(i))
    return forwards


@pytest.mark.parametrize("mode", ["r2", "off"])
def test_a_ppo_step_replays_the_old_pass_routes_in_every_update(moe_dir, mode):
    trainer = Trainer(moe_dir, _config(router_replay=mode, lr=0.3, epochs=3, grad_clip=0.0))
    used = _used_routes(trainer)
    m = trainer.step(_groups(n_groups=1))
    assert m["updates"] == 3 and m["updated"] == 1
    assert len(used) == 4  # old pass + one gradient pass per epoch (one micro-batch)
    if mode == "r2":
        assert all(torch.equal(u, used[0]) for u in used[1:])
        ((mb, recorded),) = trainer.routing._old.values()
        assert torch.equal(trainer.routing.recorded(mb), used[0]) and recorded is trainer.routing.recorded(mb)
    else:  # control: with this learning rate the router's own choice does move within the step
        assert not all(torch.equal(u, used[0]) for u in used[1:])


def test_r2_on_a_dense_model_is_refused(moe_dir):
    with pytest.raises(ValueError, match="router_replay='r2' needs a mixture-of-experts model"):
        Trainer(str(BASE), _config())
    with pytest.raises(ConfigError, match="router_replay='r2' needs a mixture-of-experts model"):
        load_config(overrides=[f"model.path={BASE}", "train.router_replay=r2"])
    # unlike r3, r2 needs no routes from the sampler, so any engine is fine
    cfg = load_config(overrides=[f"model.path={moe_dir}", "engine.kind=vllm", "train.router_replay=r2"])
    assert cfg.train.router_replay == "r2"
