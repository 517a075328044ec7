"""The built-in inference engine: a transformers model, a slot KV cache and continuous batching.

Invariants:
- One background thread (the loop) owns the model and the cache. Between two decode steps it applies pending
  weight updates, admits queued requests (prefill, first token) and retires finished sessions; a decode step
  then advances every active session by one token in one batched forward.
- ``Completion.versions[i]`` is the engine version when token ``i`` was sampled: a session started on ``v``
  continues on ``v+1`` after an update, and its tokens say which version made them.
- ``logprobs`` follow ``tandem.engine.sampling`` (distribution actually sampled from; 0.0 for greedy).
- ``SamplingParams.top_logprobs = k`` (0..``max_top_logprobs`` = 20): ``Completion.top_token_ids`` /
  ``top_logprobs`` list, per sampled token, the k alternatives ``sampling.sample_top`` reports from the very
  logits and distribution that token was sampled from. A step computes them only when a session in it
  asked (for the largest k asked; each session keeps its own k); otherwise they are None and cost nothing.
- ``submit(..., on_tokens=f)`` (``tandem.engine.front``): ``f`` gets each sampled id right after its step.
- Each session samples from its own ``torch.Generator``: the request's seed if given, else one derived from
  the engine seed and the request's submission number, so runs are reproducible.
- A bad request (empty or out-of-vocabulary prompt, prompt longer than the cache, bad parameters) gets
  ``Completion(finish_reason="error")``; nothing a caller sends stops the loop. Prompt + new tokens are
  clamped to ``max_seq_len`` (finish_reason "length" when the cache fills).
- ``update_weights`` validates every name and shape before touching anything (EngineError, state unchanged),
  then the loop copies the tensors into the HF parameters in place and refreshes derived buffers.
- ``patch_weights`` pauses serving only for what the forward reads. With ``config.double_buffer_weights`` (a
  dense model on ``FastRunner``) the caller writes the patch into the runner's idle bank while the loop
  serves from the other, and the pause only switches banks; otherwise the pause writes the served buffers
  (derived buffers, embedding, norms) in place. The remaining writes (HF parameters the forward does not
  read, the bank just switched away from) land after the pause, in the caller's thread, before
  ``patch_weights`` returns, or, with ``flush=False``, when the caller calls ``flush_deferred`` (from any
  thread, e.g. one of lower priority); they are applied in order and always before the next
  ``patch_weights`` plans and before the loop applies any later update (which may rebuild the served weights
  from the parameters). If a full update rebuilt the served weights
  between planning and switching, the switch is refused and the patch is re-planned and written in the pause.
  Concurrent ``patch_weights`` calls are serialized.
- The engine never changes global torch settings (threads are the caller's job).
- ``deterministic=True`` (the run's ``train.deterministic``): float32 and ``FastRunner`` only (else
  EngineError with the reason); every forward goes through ``tandem.model.deterministic``, so a token's
  logits, and so its sampled token and logprob, are bitwise the same whatever shares its batch; the trainer's
  deterministic forward reproduces them exactly. Sampling is per row already.
- Prefix reuse (``tandem.engine.prefix``): a finished session's KV stays parked (up to
  ``config.max_parked``, in slots beyond ``max_batch``); a request whose prompt starts with a parked sequence
  takes that slot over and prefills only the rest. Outputs equal a full prefill (up to float rounding).
  ``update_weights`` drops every parked slot, so a new request never reuses KV of older weights (sessions
  already running keep theirs, as before). Stats: ``prefill_tokens`` counts tokens actually computed,
  ``prefix_hit_tokens`` tokens reused, ``parked`` slots currently parked.
- MoE models (top-k routers, ``tandem.model.moe``; served by ``HFRunner``, or in deterministic mode by
  ``FastRunner``'s batch-invariant MoE forward): ``Completion.routed_experts`` is
  the ``[prompt + sampled tokens, moe_layers, top_k]`` expert ids (uint8, int16 above 256 experts) the
  engine's forwards chose, in router top-k order. Parked KV keeps its routes with its slot, so a reused
  prefix reports the routes it was computed with. A finished session's last sampled token is fed once more
  (one extra single-token forward per completion, MoE only) so it has routes too; its KV then stays parked
  with the rest.
"""

from __future__ import annotations

import collections
import functools
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedModel

from tandem.core.config import EngineConfig
from tandem.core.errors import EngineError, ModelLoadError
from tandem.core.generation import Completion, GenerationRequest
from tandem.engine.checks import OnLive, Patches, check_request, convert_patches, convert_tensors
from tandem.engine.front import Pending, RequestFront, error_completion, notify, resolve
from tandem.engine.prefix import PrefixCache
from tandem.engine.runner import FastRunner, HFRunner, fast_supported
from tandem.engine.sampling import UniformStream, sample_top
from tandem.engine.writes import Write, apply_writes, warm_apply_writes

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_PREFILL_TOKEN_BUDGET = 4096  # padded prompt tokens per prefill batch


@dataclass
class _Session:
    request: GenerationRequest
    future: Future
    rng: UniformStream
    max_new: int
    stop: frozenset[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    logmass: list[float] = field(default_factory=list)
    on_tokens: Callable[[list[int]], None] | None = None
    top_k: int = 0
    top_ids: list[list[int]] = field(default_factory=list)
    top_lps: list[list[float]] = field(default_factory=list)


@dataclass
class _Update:
    """A queued weight change: full ``tensors`` and/or element ``patches`` (flat index, values)."""

    version: int
    tensors: dict[str, torch.Tensor]
    patches: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    writes: list[Write] = field(default_factory=list)  # ``patches`` planned against runner ``generation``
    generation: int = -1
    swap_to: int | None = None  # the runner bank the caller already patched, to switch to in the pause
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    pause_s: float = 0.0


def _permute(order: list[int], *lists: list[Any]) -> tuple[list[Any], ...]:
    """Each of ``lists`` reordered by ``order`` (indices into it)."""
    return tuple([xs[k] for k in order] for xs in lists)


class BuiltinEngine(RequestFront):
    """Continuous-batching engine over a HF causal LM (see module docstring)."""

    max_top_logprobs = 20  # alternatives per sampled token it can report (SamplingParams.top_logprobs)

    def __init__(
        self,
        model: PreTrainedModel,
        config: EngineConfig,
        *,
        version: int = 0,
        seed: int = 0,
        dtype: str = "float32",
        deterministic: bool = False,
    ) -> None:
        if dtype not in _DTYPES:
            raise EngineError(f"dtype {dtype!r} is not supported; use one of {sorted(_DTYPES)}")
        if deterministic and dtype != "float32":
            raise EngineError(
                f"deterministic mode computes in float32 like the trainer; got dtype {dtype!r}, use float32"
            )
        self.deterministic = deterministic
        self.config = config
        self._model = model.to(_DTYPES[dtype]).eval()
        for p in self._model.parameters():
            p.requires_grad_(False)
        self.vocab_size = int(self._model.get_input_embeddings().weight.shape[0])
        self.seed = seed
        self._version = version
        reason = fast_supported(self._model)
        det_reason = fast_supported(self._model, deterministic=True) if deterministic else None
        if det_reason is not None:
            raise EngineError(
                f"deterministic mode needs the built-in fast forward, which refuses this model: {det_reason}"
            )
        runner_cls = FastRunner if reason is None else HFRunner
        self.fallback_reason = reason
        with torch.inference_mode():
            n_slots = config.max_batch + config.max_parked
            if runner_cls is FastRunner or deterministic:
                self._runner: FastRunner | HFRunner = FastRunner(
                    self._model,
                    n_slots,
                    config.max_seq_len,
                    deterministic=deterministic,
                    double_buffer=config.double_buffer_weights,
                )
            else:
                self._runner = HFRunner(self._model, n_slots, config.max_seq_len)
        self._prefix = PrefixCache(self._runner, n_slots, config.max_parked)
        self._targets = dict(self._model.state_dict(keep_vars=True))
        warm_apply_writes({t.dtype for t in self._targets.values()})
        self._work = threading.Lock()  # held while the model or the cache is used
        self._deferred: list[Callable[[], None]] = []  # work updates left for after their pause, in order
        self._write_lock = threading.RLock()  # held while weights are written outside the loop's pause
        self._patch_lock = threading.Lock()  # one patch_weights at a time
        self._updates: list[_Update] = []
        self._init_front([])  # _active: list of _Session, index == slot

    @classmethod
    def from_path(
        cls,
        path: str | Path,
        config: EngineConfig,
        *,
        dtype: str = "float32",
        seed: int = 0,
        deterministic: bool = False,
    ) -> BuiltinEngine:
        from transformers import AutoModelForCausalLM

        p = Path(path)
        if not p.is_dir():
            raise ModelLoadError(f"model path {p} is not a directory; pass a local HF model directory")
        try:
            model = AutoModelForCausalLM.from_pretrained(str(p), local_files_only=True)
        except Exception as e:  # noqa: BLE001 - any loader failure is a bad path for the caller
            raise ModelLoadError(f"could not load a causal LM from {p}: {e}") from e
        return cls(model, config, dtype=dtype, seed=seed, deterministic=deterministic)

    # ---- public API ------------------------------------------------------------------------------

    @property
    def model(self) -> PreTrainedModel:
        """The HF model whose parameters hold the weights served now (patches leave some of them to be
        restored from the served bank: ``FastRunner``; that happens here, on access, so read parameters
        through a fresh ``engine.model`` after an update)."""
        with self._write_lock:
            self._flush_deferred()
            if isinstance(self._runner, FastRunner) and self._runner.params_stale:
                self._runner.restore_params()
        return self._model

    @property
    def version(self) -> int:
        return self._version

    def stop(self) -> None:
        """Stop the loop and answer every queued and active request with "engine stopped". The engine is
        stopped from the first moment: a ``submit`` while the loop winds down is refused, never a reason to
        start the loop again (it once did: a request arriving during the join restarted the loop, so the
        engine served on and ``stop`` waited forever)."""
        with self._cv:
            self._running = False
            self._stopped = True
            self._cv.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()
        with self._cv:
            self._thread = None
            pending, self._queue = list(self._queue), collections.deque()
            sessions, self._active = self._active, []
            updates, self._updates = self._updates, []
        with self._work:
            self._prefix.drop_all()
        for item in [*pending, *sessions]:
            resolve(item.future, error_completion("engine stopped"))
        for u in updates:
            u.error = EngineError("engine stopped before the weight update was applied")
            u.done.set()

    def update_weights(self, version: int, tensors: dict[str, np.ndarray | torch.Tensor]) -> float:
        """Copy ``tensors`` into the parameters between decode steps; later tokens carry ``version``.

        ``uint16`` arrays for floating-point parameters are bfloat16 bit patterns (the trainer's publish
        format). Returns the pause in seconds (copy plus rebuilding derived buffers: a full reload)."""
        converted = convert_tensors(self._targets, tensors)
        update = _Update(int(version), converted)
        self._run_update(update)
        self._flush_deferred()  # e.g. the second weight bank, copied from the one now served
        return update.pause_s

    def patch_weights(
        self, version: int, patches: Patches, on_live: OnLive = None, flush: bool = True
    ) -> float:
        """Set elements of parameters in place between decode steps: ``patches[name] = (flat_index, values)``
        (values as in ``update_weights``: uint16 means bfloat16 bit patterns).

        Everything is validated before anything is touched (EngineError naming the tensor, state unchanged);
        served buffers are patched element-wise, not rebuilt: in the idle bank before the pause, which then
        only switches banks (double buffering), or inside the pause, in proportion to the number of changed
        elements. Later tokens carry ``version``; ``on_live`` is called (in this thread) once the engine
        serves it, before the writes left for after the pause; ``flush=False`` leaves those writes to
        ``flush_deferred`` (the caller's job, typically on a lower-priority thread). Returns the pause in
        seconds.
        """
        converted = convert_patches(self._targets, patches)
        with self._patch_lock:
            self._flush_deferred()  # the plan below must see every bank
            update = _Update(int(version), {}, converted)
            # Index arithmetic now, in the caller's thread: the loop only switches banks or scatters (unless
            # a full update rebuilt the served weights in between, then it re-plans).
            update.generation = self._runner.generation
            update.writes = self._plan(converted)
            runner = self._runner
            if isinstance(runner, FastRunner) and runner.double_buffer:
                with self._write_lock:
                    if runner.generation == update.generation and runner.banks == 2:
                        idle = 1 - runner.active
                        with torch.inference_mode():
                            apply_writes([w for w in update.writes if w.bank == idle])
                        update.swap_to = idle
            try:
                self._run_update(update)
            except BaseException:
                if update.swap_to is not None and isinstance(runner, FastRunner):
                    with self._write_lock:  # never switched to: the idle bank goes back to the served weights
                        if runner.generation == update.generation and runner.active != update.swap_to:
                            runner.sync_bank(update.swap_to)
                raise
            if on_live is not None:
                on_live()  # the loop serves the new version from here on
            if flush:
                self._flush_deferred()  # off the serving path
        return update.pause_s

    def flush_deferred(self) -> None:
        """Apply the writes earlier updates left for after their pause (``patch_weights(flush=False)``)."""
        self._flush_deferred()

    def _flush_deferred(self) -> None:
        """Do the work applied updates left for after their pause, oldest first (any thread)."""
        with self._write_lock:
            pending, self._deferred = self._deferred, []
            if pending:
                with torch.inference_mode():
                    for job in pending:
                        job()

    def _plan(self, patches: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> list[Write]:
        plan = self._runner.plan_patch
        return [w for name, (i, v) in patches.items() for w in plan(self._targets[name], i, v)]

    def _run_update(self, update: _Update) -> None:
        with self._cv:
            if self._running:
                self._updates.append(update)
                self._cv.notify_all()
                queued = True
            else:
                queued = False
        if not queued:
            with self._work:  # no loop iteration in progress: nobody else touches the model
                self._apply(update)
        update.done.wait()
        if update.error is not None:
            raise update.error

    def stats(self) -> dict[str, Any]:
        with self._cv:
            return {**self._stats, "parked": len(self._prefix), "uptime_s": time.monotonic() - self._t0}

    # ---- the loop --------------------------------------------------------------------------------

    def _iteration(self, updates: list[_Update], admitted: list[Pending]) -> None:
        with self._work:
            for u in updates:
                self._apply(u)
            with torch.inference_mode():
                self._admit(admitted)
                if self._active:
                    self._step()

    def _apply(self, u: _Update) -> None:
        t0 = time.perf_counter()
        self._write_lock.acquire()
        try:
            self._flush_deferred()  # an earlier patch's late writes first: refresh() reads the parameters
            runner = self._runner
            if u.tensors and isinstance(runner, FastRunner) and runner.params_stale:
                if {id(self._targets[n]) for n in u.tensors} >= runner.restorable_ids():
                    runner.params_stale = False  # every lagging parameter is overwritten below
                else:
                    runner.restore_params()
            with torch.no_grad():
                for name, t in u.tensors.items():
                    self._targets[name].copy_(t)
                if u.tensors:
                    if isinstance(self._runner, FastRunner) and self._runner.double_buffer:
                        self._runner.refresh(both_banks=False)  # serve one bank now...
                        self._deferred.append(self._runner.add_second_bank)  # ...the copy after the pause
                    else:
                        self._runner.refresh()
            if u.patches and u.swap_to is not None and u.generation == self._runner.generation:
                assert isinstance(self._runner, FastRunner)
                self._runner.activate(u.swap_to)  # the caller wrote this bank; the other one follows
                self._runner.params_stale = True  # the plan left the HF parameters out (restore_params)
                rest = [w for w in u.writes if w.bank != u.swap_to]
                self._deferred.append(functools.partial(apply_writes, rest))
            elif u.patches:
                writes = u.writes
                if u.generation != self._runner.generation:
                    writes = self._plan(u.patches)
                if isinstance(self._runner, FastRunner) and self._runner.double_buffer:
                    self._runner.params_stale = True  # as above
                served = [w for w in writes if not w.deferred]
                with torch.inference_mode():  # the served buffers are inference tensors
                    apply_writes(served)
                if len(served) < len(writes):
                    self._deferred.append(functools.partial(apply_writes, [w for w in writes if w.deferred]))
            self._version = u.version
        except Exception as e:  # noqa: BLE001 - reported to the caller
            u.error = EngineError(f"update_weights to version {u.version} failed: {e}")
        finally:
            self._write_lock.release()
            self._prefix.drop_all()  # parked KV is of the old weights (also after a partial failure)
            u.pause_s = time.perf_counter() - t0
            u.done.set()

    def _check(self, req: GenerationRequest) -> str | int:
        """Error message, or the number of new tokens this request may sample."""
        k = req.params.top_logprobs
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= self.max_top_logprobs:
            return f"top_logprobs={k!r} must be an integer in [0, {self.max_top_logprobs}]"
        return check_request(req, self.vocab_size, self.config.max_seq_len)

    def _admit(self, admitted: list[Pending]) -> None:
        fresh: list[_Session] = []
        for item in admitted:
            check = self._check(item.request)
            if isinstance(check, str):
                resolve(item.future, error_completion(check))
                continue
            sp = item.request.params
            seed = sp.seed if sp.seed is not None else self.seed * 1_000_003 + item.number
            stop = frozenset(sp.stop_token_ids)
            session = _Session(item.request, item.future, UniformStream(seed), check, stop)
            session.on_tokens, session.top_k = item.on_tokens, sp.top_logprobs
            fresh.append(session)
        # Claim parked prefixes for all of them first, so each parked slot serves at most one request.
        claims: list[int | None] = []
        starts: list[int] = []
        for s in fresh:
            hit = self._prefix.claim([int(t) for t in s.request.prompt_ids])
            claims.append(hit[0] if hit else None)
            starts.append(hit[1] if hit else 0)
        # Sessions back for their next turn in slot order: a lockstep group that parked in slots n..n+k-1
        # is prefilled in place, with no KV copied (see ``PrefixCache.arrange``).
        slots = [self._prefix.slot_of(c) for c in claims]
        order = sorted(range(len(fresh)), key=lambda k: (slots[k] is None, slots[k] or 0))
        fresh, claims, starts = _permute(order, fresh, claims, starts)
        i = 0
        while i < len(fresh):  # batches under a padded-token budget (new tokens), at least one prompt each
            j, longest = i, 0
            while j < len(fresh):
                longest2 = max(longest, len(fresh[j].request.prompt_ids) - starts[j])
                if j > i and longest2 * (j - i + 1) > _PREFILL_TOKEN_BUDGET:
                    break
                longest, j = longest2, j + 1
            first = len(self._active)
            fresh[i:j], claims[i:j], starts[i:j] = _permute(
                self._prefix.arrange(first, claims[i:j]), fresh[i:j], claims[i:j], starts[i:j]
            )
            batch = fresh[i:j]
            suffixes = [list(s.request.prompt_ids[st:]) for s, st in zip(batch, starts[i:j], strict=True)]
            try:
                self._prefix.place(first, claims[i:j])
                logits = self._runner.prefill(first, suffixes, starts[i:j])
            except Exception as e:  # noqa: BLE001 - fail these sessions, keep the others
                for k in range(len(batch)):
                    self._runner.release(first + k)
                for s in batch:
                    resolve(s.future, error_completion(f"prefill failed: {type(e).__name__}: {e}"))
                i = j
                continue
            self._active.extend(batch)
            with self._cv:
                self._stats["prefill_tokens"] += sum(len(x) for x in suffixes)
                self._stats["prefix_hit_tokens"] += sum(starts[i:j])
            self._sample_and_retire(logits, first)
            i = j

    def _step(self) -> None:
        last = torch.tensor([s.tokens[-1] for s in self._active])
        logits = self._runner.decode(last)
        with self._cv:
            self._stats["steps"] += 1
        self._sample_and_retire(logits, 0)

    def _sample_and_retire(self, logits: torch.Tensor, first: int) -> None:
        """Sample for sessions ``first..first+len(logits)-1``, record tokens, retire finished ones."""
        sessions = self._active[first : first + logits.shape[0]]
        temps = torch.tensor([s.request.params.temperature for s in sessions], dtype=torch.float32)
        top_p = torch.tensor([s.request.params.top_p for s in sessions], dtype=torch.float32)
        us = torch.tensor([s.rng.next() if s.request.params.temperature > 0 else 1.0 for s in sessions])
        top_k = max(s.top_k for s in sessions)
        tokens, lps, logmass, top = sample_top(logits, temps, top_p, us, top_k)
        top_ids = top.token_ids.tolist() if top is not None else []
        top_lps = top.logprobs.tolist() if top is not None else []
        version = self._version
        finished: list[int] = []
        rows = zip(sessions, tokens.tolist(), lps.tolist(), logmass.tolist(), strict=True)
        for k, (s, tok, lp, lm) in enumerate(rows):
            s.tokens.append(tok)
            s.logprobs.append(lp)
            s.logmass.append(lm)
            s.versions.append(version)
            if s.top_k:
                s.top_ids.append(top_ids[k][: s.top_k])
                s.top_lps.append(top_lps[k][: s.top_k])
            notify(s, [tok])
            if tok in s.stop or len(s.tokens) >= s.max_new or s.future.cancelled():
                finished.append(first + k)  # a cancelled one (its caller gave up) stops here, unanswered
        with self._cv:
            self._stats["tokens_generated"] += len(sessions)
            self._stats["last_token_at"] = time.monotonic()
        sequences: dict[int, list[int]] = {}
        for slot in finished:
            s = self._active[slot]
            reason = "stop" if s.tokens[-1] in s.stop else "length"
            if s.future.cancelled():
                with self._cv:
                    self._stats["cancelled"] += 1
            completion = Completion(s.tokens, s.logprobs, s.versions, reason, logmass=s.logmass)
            if s.top_k:
                completion.top_token_ids, completion.top_logprobs = s.top_ids, s.top_lps
            if self._runner.records_routes:
                self._runner.feed(slot, s.tokens[-1])
                completion.routed_experts = self._runner.routes(slot).copy()
            resolve(s.future, completion)
            sequences[slot] = [int(t) for t in (*s.request.prompt_ids, *s.tokens)]
        if finished:
            self._retire(sequences)

    def _retire(self, sequences: dict[int, list[int]]) -> None:
        """Retire the sessions in the given slots (parking the KV of each whose sequence may be reused) so
        the active slots stay contiguous (``0..n'-1``), copying as little KV as it can: a finished slot at
        or above ``n'`` keeps its KV where it is; each one below takes a running session from at or above
        ``n'``, its own KV parked in a free slot first (two copies per such pair). Sessions finishing
        together after their admission was split (an HTTP harness's group arriving in two bursts) used to
        cost two copies each; retiring a whole lockstep group costs none."""
        n = len(self._active)
        keep = n - len(sequences)
        holes = sorted(slot for slot in sequences if slot < keep)
        movers = [slot for slot in range(keep, n) if slot not in sequences]
        for hole, mover in zip(holes, movers, strict=True):
            if self._prefix.park(hole, n, sequences[hole], in_place=False):
                self._expect_return()
            self._runner.move(mover, hole)
            self._active[hole] = self._active[mover]
        for slot in sorted(slot for slot in sequences if slot >= keep):
            if self._prefix.park(slot, n, sequences[slot], in_place=True):
                self._expect_return()
            else:
                self._runner.release(slot)
        del self._active[keep:]

    def _fail_active(self, msg: str) -> None:
        sessions, self._active = self._active, []
        for slot in range(len(sessions)):
            self._runner.release(slot)
        self._prefix.drop_all()
        for s in sessions:
            resolve(s.future, error_completion(msg))
