"""The serve command: load a checkpoint, compile its decoding, and serve it over HTTP until stopped.

    python -m lm.serve RUN_DIR|hf:DIR|s3://...|gs://... [--host 127.0.0.1] [--port 8000] [--max-batch 16]
                       [--max-len N] [--max-request-mb 16] [--name NAME] [--step N | --best]

Prints `serving NAME at http://HOST:PORT` once it answers requests (--port 0 picks a free port, which that
line names). Needs the serve extra: pip install 'lm[serve]'.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import signal
import socket
import sys
import threading
import time

from lm import checkpoint as ckpt_lib
from lm import compile_cache, sharding, storage
from lm import runs as runs_lib
from lm.config import MeshConfig, SampleConfig
from lm.errors import (
    ArgumentParser, UserError, cli, ctrl_c_kept, fits_in_memory, memory_size, plural, stop_signals_kill,
)
from lm.pretrained import HF_PREFIX, checkpoint_source, config_and_tokenizer, hf_sample_settings, load, sample_settings
from lm.run_dir import RunDir
from lm.sampling.loop import cache_bytes
from lm.sampling.slots import penalties_bytes

MAX_BATCH = 16
MAX_REQUEST_MB = 16.0  # a larger request body is refused (413) before it is read: parsing it would take seconds
GRACE_S = 5.0  # how long requests in progress have to finish once the server is told to stop (--grace)
FORCE_QUIT = "(CTRL+C to force quit)"  # what uvicorn's shutdown log lines end with
AGAIN = "(Ctrl-C again: what is left ends now with a 503; a third time: quit at once)"


def _parser() -> ArgumentParser:
    p = ArgumentParser(
        prog="python -m lm.serve",
        description="Serve a trained model over HTTP with OpenAI's API: /v1/completions, /v1/chat/completions, "
        "/v1/models, /health.",
    )
    p.add_argument("model", nargs="?", type=storage.user_path,
        help="run, checkpoints or step directory, or hf:DIR (default: the newest run)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1; 0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (8000; 0 = any free port)")
    p.add_argument(
        "--max-batch", type=int, default=MAX_BATCH, help=f"rows decoded together; more requests wait ({MAX_BATCH})"
    )
    p.add_argument(
        "--max-len",
        type=int,
        help="tokens a request's prompt and reply may take together (default: the model's window); the KV cache "
        "holds --max-batch rows of this length, and each step reads all of it",
    )
    p.add_argument(
        "--max-request-mb",
        type=float,
        default=MAX_REQUEST_MB,
        help=f"largest request body accepted, in MiB; a larger one is refused with 413 ({MAX_REQUEST_MB:g})",
    )
    p.add_argument(
        "--grace",
        type=float,
        default=GRACE_S,
        help=f"seconds the requests in progress have to finish once the server is told to stop ({GRACE_S:g})",
    )
    p.add_argument("--name", help="the model's name in the API (default: the path given)")
    p.add_argument(
        "--compile-all", action="store_true",
        help="compile at start every program a request can need (each prompt length bucket, top-p, logprobs, "
        "penalties, echo), so that no request waits for a compile and holds back the others; without it, a greedy "
        "admission and step are compiled at start and the rest when first asked for",
    )  # fmt: skip
    p.add_argument(
        "-q", "--quiet", action="store_true",
        help="no access log nor uvicorn's start and stop lines (lm's loading and ready lines stay, and warnings)",
    )  # fmt: skip
    p.add_checkpoint_choice()
    compile_cache.add_option(p)
    return p


def request_defaults(source: str) -> tuple[dict, int, list[str]]:
    """({"temperature", "top_p"} of a request that leaves them out, the top_k of every sampled row, notes on the
    settings not applied): the model's recommended settings, as vLLM serves them: an hf:DIR's generation_config.json
    (lm.hf.generation's reading) over OpenAI's (1, 1, no top-k), a run's own `sample` settings (what sample.py
    samples it with, and its export's generation_config.json holds: the same weights are served alike either way)."""
    if source.startswith(HF_PREFIX):
        settings, notes = hf_sample_settings(source, SampleConfig(temperature=1.0, top_k=0, top_p=1.0))
    else:
        settings, notes = sample_settings(source), []
    return {"temperature": settings.temperature, "top_p": settings.top_p}, settings.top_k, notes


def _listen(host: str, port: int) -> socket.socket:
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        raise UserError(
            f"cannot listen on {host}:{port} ({e.strerror or e}); choose another --port or --host"
        ) from None
    sock.listen(2048)  # connections made from now on wait in the backlog until the server takes them
    return sock


def _warm_up(scheduler, tokenizer, window: int, every: bool) -> None:
    """Compile an admission and a step before the first request (a row of two greedy tokens), and with `every`,
    every other program a request can need (lm.sampling.slots.Slots.compile_all), before the scheduler's loop
    takes any."""
    from lm.serve.scheduler import Choice

    if every:
        start = time.perf_counter()
        ran = scheduler.slots.compile_all()
        print(f"compiled {ran} programs in {time.perf_counter() - start:.1f} s: no request waits for a compile",
              file=sys.stderr, flush=True)  # fmt: skip

    finished = threading.Event()
    failed = []

    def sink(events, error):
        failed.extend([error] if error else [])
        if error or any(e.finish for e in events):
            finished.set()

    scheduler.submit([Choice([tokenizer.eot], max_tokens=min(2, window - 1), temperature=0.0)], sink)
    finished.wait()
    if failed:
        raise UserError(f"the model cannot decode here: {failed[0]}")


def _server(uvicorn, app, scheduler, log_level: str, grace: float):
    """uvicorn's server, stopping as a server under load should. A first Ctrl-C or SIGTERM stops accepting
    connections and gives the requests in progress `grace` seconds to finish; then the scheduler drains: what is
    still running or waiting ends with a 503 error (a stream with that error event and [DONE]), so that no client
    is cut off without an answer. A second Ctrl-C drains at once; a third quits without waiting. SIGHUP (its
    terminal closed: an ssh session that dropped) stops it as SIGTERM does, unless it was ignored when the server
    started (`nohup`); uvicorn's own signals are SIGINT and SIGTERM, and SIGHUP cut every request off."""

    class Server(uvicorn.Server):
        signals = 0

        @contextlib.contextmanager
        def capture_signals(self):
            # (which ends by raising the signals it caught, SIGHUP too, once stopped: they end the process)
            with stop_signals_kill(), super().capture_signals():
                hup = getattr(signal, "SIGHUP", None)
                main = threading.current_thread() is threading.main_thread()
                if hup is None or not main or signal.getsignal(hup) == signal.SIG_IGN:
                    yield
                    return
                previous = signal.signal(hup, self.handle_exit)
                try:
                    yield
                finally:
                    signal.signal(hup, previous)

        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            self.signals += 1
            if self.signals == 1:
                timer = threading.Timer(grace, scheduler.drain)
                timer.daemon = True
                timer.start()
            elif self.signals == 2:
                self.force_exit = False  # uvicorn's own second Ctrl-C quits at once, cutting every request off
                scheduler.drain()

    # uvicorn logs each request to stdout, which then fills a pipe that a script reads the ready line from (and
    # nothing else): once its 64 KiB were full, the next request's log line held the event loop, and the server
    # hung, SIGTERM too. Here stdout carries the ready line alone, and every log line goes to stderr.
    log_config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    log_config["handlers"]["access"]["stream"] = "ext://sys.stderr"
    # uvicorn cancels what is still running some seconds after the drain: a handler waits a step at most to hear of it.
    config = uvicorn.Config(
        app, log_level=log_level, log_config=log_config, timeout_graceful_shutdown=grace + GRACE_S
    )
    server = Server(config)
    logging.getLogger("uvicorn.error").addFilter(_say_what_ctrl_c_does)  # (after the Config, which sets up logging)
    return server


def _say_what_ctrl_c_does(record: logging.LogRecord) -> bool:
    """uvicorn's "Waiting for connections to close. (CTRL+C to force quit)", as what a second Ctrl-C does here."""
    if isinstance(record.msg, str) and record.msg.endswith(FORCE_QUIT):
        record.msg = record.msg.removesuffix(FORCE_QUIT) + AGAIN
    return True


@cli
def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.max_batch < 1:
        raise UserError(f"--max-batch must be >= 1, got {args.max_batch}")
    if not 0 <= args.port < 65536:
        raise UserError(f"--port must be in [0, 65535], got {args.port}")
    if not 0 <= args.grace <= threading.TIMEOUT_MAX:  # (a threading.Timer waits at most that long)
        raise UserError(f"--grace must be a number of seconds in [0, {threading.TIMEOUT_MAX:.0f}], got {args.grace}")
    if not 0.001 <= args.max_request_mb < math.inf:  # (1e-9 was 0 bytes: a server that refused every request)
        raise UserError(f"--max-request-mb must be a number of MiB >= 0.001 (1 KiB), got {args.max_request_mb}")
    if not args.host.strip():  # (bound as every interface: a server open to the network, from an unset $HOST)
        raise UserError("--host must not be empty; give an address (127.0.0.1, or 0.0.0.0 for every interface)")
    if args.name is not None and not args.name.strip():  # (it fell back to the path: a name the client never gave)
        raise UserError("--name must not be empty; give the model's name in the API, or drop it for the path given")
    if args.max_len is not None and args.max_len < 2:
        raise UserError(f"--max-len must be >= 2 (a prompt token and a new one), got {args.max_len}")
    try:
        import uvicorn

        from lm.serve.app import create_app
    except ImportError as e:
        raise UserError(f"serving needs {e.name}: pip install 'lm[serve]'") from None
    from lm.serve.api import Served
    from lm.serve.scheduler import Scheduler

    target = runs_lib.given_or_latest(args.model)
    source = checkpoint_source(target, args.step, args.best)
    model_cfg, tokenizer = config_and_tokenizer(source)
    defaults, top_k, notes = request_defaults(source)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    if tokenizer.n_vocab > model_cfg.vocab_size:
        raise UserError(f"the tokenizer has {tokenizer.n_vocab} ids but the model only {model_cfg.vocab_size}")
    window, limit = model_cfg.max_seq_len, "the model's context window"
    if args.max_len is not None:
        if args.max_len > window:
            raise UserError(f"--max-len {args.max_len} is more than the model's context window of {window} tokens; "
                            "lower it or drop it")  # fmt: skip
        window, limit = args.max_len, "the server's --max-len"
    sock = _listen(args.host, args.port)  # before the slow part: a port in use fails at once
    compile_cache.for_command(args.compile_cache)
    with ctrl_c_kept():  # (one that JAX's callbacks swallowed as it loaded or compiled left it serving)
        print(f"loading {RunDir(target).shown(source)}", file=sys.stderr, flush=True)
        mesh = sharding.make_mesh(MeshConfig())
        params, model_cfg, tokenizer = load(source, mesh=mesh)
        ckpt_lib.release_reading()  # (the weights are in memory: the step may go with its run's rotation)
        # a device's share: the cache, and the rows' penalty counts and logit bias (made at start, not by a request)
        needed = cache_bytes(model_cfg, args.max_batch, window, mesh) + penalties_bytes(model_cfg, args.max_batch, mesh)
        cache = (
            f"a KV cache of {args.max_batch} rows of {window} tokens and their sampling state ({memory_size(needed)} a "
            "device) beside the model"
        )
        with fits_in_memory(cache, "lower --max-batch or --max-len", needed=needed):  # (refused at once beyond it)
            scheduler = Scheduler(params, model_cfg, tokenizer, args.max_batch, window, top_k)
            _warm_up(scheduler, tokenizer, window, args.compile_all)
    served = Served(args.name or target.rstrip("/"), tokenizer, window, limit, **defaults)
    host, port = sock.getsockname()[:2]
    host = f"[{host}]" if ":" in host else host  # an IPv6 address, as a URL writes it
    slots = plural(args.max_batch, "slot")
    ready = f"serving {served.name} at http://{host}:{port} ({slots} of {window} tokens)"
    on_ready = lambda: print(ready, flush=True)  # noqa: E731 (once Ctrl-C stops it cleanly)
    app = create_app(scheduler, served, args.max_request_mb, on_ready=on_ready)
    server = _server(uvicorn, app, scheduler, "warning" if args.quiet else "info", args.grace)
    server.run(sockets=[sock])
    scheduler.close()
    return 0
