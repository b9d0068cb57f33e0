"""Server configuration: one dataclass, settable from a TOML file and from flags.

Every field carries its help text; the CLI builds one flag per field from it, so `--help`
and the TOML keys can never drift apart. Precedence: defaults < TOML file < flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import tomllib
from dataclasses import dataclass, field
from typing import Any

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
DTYPES = ("auto", "bfloat16", "bf16", "float16", "fp16", "half", "float32", "fp32", "float")
DTYPES += ("float64", "fp64", "double")
# zmq endpoints the server can bind: tcp://HOST:PORT (HOST may be * or an interface), ipc://PATH
WIRE_FORMATS = ("bf16", "projected", "fp8")  # protocol.wire.FORMATS (the config imports nothing of the runtime)
ENDPOINT = re.compile(r"^(tcp://(\[[0-9a-fA-F:.]+\]|[^:/\s]+):(\d+|\*)|ipc://\S+|inproc://\S+)$")


class StartupError(RuntimeError):
    """A start-up failure an operator fixes (a port in use, no GPU): printed as one line, exit code 2."""


def _type_name(typ: type) -> str:
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[typ]


def _check_type(name: str, typ: type, value: Any) -> Any:
    """The TOML value converted to the field's type, or ValueError naming the key."""
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        str: isinstance(value, str),
    }[typ]
    if not ok:
        raise ValueError(f"{name} = {value!r}: expected {_type_name(typ)}")
    return float(value) if typ is float else value


def _f(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass
class ServerConfig:
    # --- endpoints
    bind: str = _f(
        "tcp://127.0.0.1:5557",
        "ZeroMQ endpoint(s) the ROUTER socket binds, comma-separated (loopback by default), e.g. "
        "tcp://0.0.0.0:5557,ipc:///run/draft/draft.sock: tcp for remote engines, ipc for a co-located one",
    )
    shm: bool = _f(
        True,
        "let clients on this host send rows through a shared-memory ring (transport 'shm'; mapped read-only, "
        "only segments of this server's own uid); --no-shm refuses such clients at Hello",
    )
    cuda_ipc: bool = _f(
        True,
        "let clients on this host send rows from their GPU through a CUDA IPC buffer (transport 'cuda_ipc': "
        "imported on the drafter's CUDA device, copied device to device, a peer copy between two GPUs); "
        "--no-cuda-ipc (or a drafter on the CPU) refuses such clients at Hello",
    )
    arena_mib: int = _f(
        64,
        "host memory in MiB that Step tap frames (tcp/ipc) are received into, registered (pinned) with the GPU "
        "once, so their rows reach the device with no staging copy; about 3x the largest decode step's rows (K3, "
        "64 sessions x 3 rows: 13.8 MB). A frame that finds no room, or is larger, is received as usual and "
        "counted (draft_server_arena_fallbacks_total); 0 turns the arena off",
    )
    metrics_port: int = _f(9400, "HTTP port for /metrics (Prometheus) and /healthz; 0 picks a free port, -1 disables")
    metrics_host: str = _f("127.0.0.1", "address the metrics HTTP server listens on")
    # --- model
    drafter: str = _f("dspark", "backend: 'dspark' (needs --model) or 'checksum' (deterministic test drafter)")
    model: str = _f("", "DSpark draft checkpoint directory, or random:k3 / random:qwen3-8b (full size, random weights)")
    target_model: str = _f("", "target checkpoint directory holding lm_head.weight (and the embedding)")
    device: str = _f("auto", "torch device for the drafter: auto, cpu, cuda, cuda:N")
    dtype: str = _f("auto", "compute dtype: auto (bfloat16 on CUDA, float32 on CPU), bfloat16, float16, float32")
    kv_budget_mib: int = _f(0, "memory for the draft KV cache in MiB; 0 sizes it from free device memory")
    attention: str = _f(
        "auto", "auto (paged Triton kernels + CUDA graphs on CUDA, dense on CPU), paged, or dense (eager reference)"
    )
    block_width: str = _f(
        "k",
        "draft block rows: k (the k drafts each request asks for, as vLLM's in-process DSpark runs it) or "
        "trained (the checkpoint's block_size, first k returned); the block is not causal, so drafts differ",
    )
    wire_formats: str = _f(
        "",
        "wire formats clients may send, comma-separated from bf16, projected, fp8 (empty: every one the drafter "
        "takes; the checksum drafter takes bf16 and fp8)",
    )
    checksum_delay_ms: float = _f(0.0, "checksum drafter only: sleep this long in every draft batch (fault tests)")
    # --- limits and admission
    max_sessions: int = _f(1024, "live sessions at most; beyond it idle sessions are evicted LRU, else 'overloaded'")
    max_queue_rows: int = _f(65536, "rows waiting for ingest at most; entries beyond it are answered 'overloaded'")
    max_rows_per_step: int = _f(32768, "rows one Step message may carry")
    max_entries_per_step: int = _f(1024, "entries one Step message may carry")
    max_message_mib: int = _f(
        0, "largest message in MiB (0: the largest valid Step, from the model's tap width and max_rows_per_step)"
    )
    max_position: int = _f(1 << 24, "largest absolute position accepted")
    max_budget_ms: float = _f(60000.0, "largest per-step budget a client may ask for")
    # --- scheduling
    max_batch_rows: int = _f(4096, "rows ingested in one engine iteration (decode batch plus one prefill chunk)")
    max_batch_sessions: int = _f(256, "sessions drafted in one engine iteration")
    prefill_chunk_rows: int = _f(512, "longer entries are ingested in chunks of this size between decode batches")
    batch_window_ms: float = _f(0.0, "a fixed wait before each decode batch (0: none, only for clients due back)")
    idle_spin_ms: float = _f(
        0.0,
        "the idle engine polls for work without sleeping from this long before the first client due back "
        "(its learnt turnaround after its drafts) until this long after (with none due: for this long after "
        "the last batch), and through its short waits (holds, commits due), trading CPU for the time a sleeping "
        "thread takes to wake (e.g. 1); 0: it sleeps at once",
    )
    session_ttl_s: float = _f(300.0, "idle sessions are freed after this many seconds")
    watchdog_s: float = _f(10.0, "an engine iteration longer than this turns health red")
    watchdog_exit: bool = _f(
        False,
        "exit the process (code 3) when the watchdog fires, for an orchestrator to restart; it first waits for "
        "the next /metrics scrape (at most 15 s) so that the alerts see it",
    )
    # --- security
    curve_secret_key_file: str = _f("", "CurveZMQ: server secret key file (`draft-server keygen`); enables encryption")
    curve_allow_dir: str = _f("", "CurveZMQ: directory of allowed client public key files (empty: any client key)")
    # --- logging
    log_level: str = _f("INFO", "logging level")

    @classmethod
    def from_toml(cls, path: str) -> ServerConfig:
        """Load a TOML file; every error (missing file, syntax, unknown key, wrong type) names the file."""
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except OSError as e:
            raise ValueError(f"{path}: cannot read the config file: {e.strerror or e}") from None
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{path}: not valid TOML: {e}") from None
        data = data.get("server", data)
        types = {f.name: _FIELD_TYPES[str(f.type)] for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(types))
        if unknown:
            raise ValueError(f"{path}: unknown config keys {unknown}")
        try:
            return cls(**{k: _check_type(k, types[k], v) for k, v in data.items()})
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None

    def validate(self) -> None:
        positive = [
            "max_sessions",
            "max_queue_rows",
            "max_rows_per_step",
            "max_entries_per_step",
            "max_position",
            "max_batch_rows",
            "max_batch_sessions",
            "prefill_chunk_rows",
        ]
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.arena_mib < 0:
            raise ValueError(f"arena_mib must be >= 0 (0: no receive arena), got {self.arena_mib}")
        if self.max_message_mib < 0:
            raise ValueError(f"max_message_mib must be >= 0 (0: sized from the model), got {self.max_message_mib}")
        for name in ["max_budget_ms", "session_ttl_s", "watchdog_s"]:
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.batch_window_ms < 0 or self.checksum_delay_ms < 0 or self.idle_spin_ms < 0:
            raise ValueError("batch_window_ms, idle_spin_ms and checksum_delay_ms must be >= 0")
        if self.prefill_chunk_rows > self.max_batch_rows:
            raise ValueError("prefill_chunk_rows must be <= max_batch_rows")
        if self.attention not in ("auto", "paged", "dense"):
            raise ValueError(f"unknown attention {self.attention!r} (auto, paged, dense)")
        if self.block_width not in ("k", "trained"):
            raise ValueError(f"unknown block width {self.block_width!r} (k, trained)")
        if self.drafter not in ("dspark", "checksum"):
            raise ValueError(f"unknown drafter {self.drafter!r} (dspark, checksum)")
        if self.drafter == "dspark" and not self.model:
            raise ValueError("--model is required with the dspark drafter")
        binds = [b.strip() for b in self.bind.split(",")]
        for b in binds:
            if not ENDPOINT.match(b):
                raise ValueError(
                    f"bind {b!r} is not a ZeroMQ endpoint (tcp://HOST:PORT, e.g. tcp://127.0.0.1:5557, or ipc:///PATH)"
                )
        if len(set(binds)) != len(binds):
            raise ValueError(f"bind {self.bind!r} names an endpoint twice")
        if not -1 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port {self.metrics_port} is not a port (0 picks one, -1 disables)")
        if not self.metrics_host.strip():
            raise ValueError("metrics_host is empty (e.g. 127.0.0.1 or 0.0.0.0)")
        if not DEVICE.match(self.device):
            raise ValueError(f"unknown device {self.device!r} (auto, cpu, cuda, cuda:N)")
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r} (auto, bfloat16, float16, float32)")
        unknown = [f for f in (x.strip() for x in self.wire_formats.split(",")) if f and f not in WIRE_FORMATS]
        if unknown:
            raise ValueError(f"unknown wire formats {unknown} (bf16, projected, fp8)")
        if self.log_level.upper() not in LOG_LEVELS:
            raise ValueError(f"unknown log_level {self.log_level!r} ({', '.join(LOG_LEVELS)})")


_FIELD_TYPES = {"bool": bool, "int": int, "float": float, "str": str}


def add_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per config field, defaulting to None so that TOML values survive."""
    for f in dataclasses.fields(ServerConfig):
        flag = "--" + f.name.replace("_", "-")
        help_text = f"{f.metadata['help']} (default: {f.default})"
        if f.type in ("bool", bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            typ = _FIELD_TYPES[str(f.type)]
            parser.add_argument(flag, type=typ, default=None, help=help_text, metavar=f.name.upper())


def from_args(args: argparse.Namespace) -> ServerConfig:
    cfg = ServerConfig.from_toml(args.config) if getattr(args, "config", None) else ServerConfig()
    for f in dataclasses.fields(ServerConfig):
        value = getattr(args, f.name, None)
        if value is not None:
            setattr(cfg, f.name, value)
    cfg.validate()
    return cfg
