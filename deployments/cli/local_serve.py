"""`mmserve serve`: an embedded Ray cluster on this machine (its head started as `deployments.cli.ray_head`
starts it), the app deployed on it, drained on SIGTERM / Ctrl-C, and nothing exposed that the operator
did not ask for: the API key only from the environment (`--api-key` warns), Ray's token authentication
required, Ray's ports on loopback (single-machine mode) unless `--public-metrics`, Serve's keyless gRPC
proxy only when `--grpc-port` asks for it, the request cap in front of the HTTP port (`ingress_modes`).
"mmserve ready" is printed once the app answers ready (what `/health` says); a signal before that stops
everything cleanly (exit 0), one after it drains first. The command: docs/operations.md#mmserve-serve;
what listens where, per `--ingress` mode: docs/security.md#what-listens-where.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

API_KEY_ENV = "MMSERVE_API_KEY"
APP_IMPORT_PATHS = ("deployments.serve.app:build_app", "deployments.serve.app.build_app")  # what --config can key
SINGLE_MACHINE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": Ray's node address is loopback (read at import)


class RefusedToStart(Exception):
    """A configuration `mmserve serve` will not start with; the message says why and what to do."""


def ray_token_auth_on() -> bool:
    """Whether the Ray cluster `ray.init` starts here requires Ray's token: Ray (2.5x and later)
    turns token authentication on for a new local cluster unless `RAY_AUTH_MODE` says otherwise."""
    import importlib.util

    ray_spec = importlib.util.find_spec("ray")  # (without importing Ray: see use_single_machine_mode)
    if ray_spec is None or not (Path(ray_spec.origin).parent / "_private" / "authentication").is_dir():
        return False  # a Ray without token authentication
    return os.environ.get("RAY_AUTH_MODE", "token").lower() == "token"


def token_location() -> str:
    return ("the RAY_AUTH_TOKEN environment variable" if os.environ.get("RAY_AUTH_TOKEN")
            else os.environ.get("RAY_AUTH_TOKEN_PATH") or str(Path.home() / ".ray" / "auth_token"))


def check_ray_token_auth() -> None:
    """RefusedToStart while Ray's token authentication is off, whatever `--host` says: Serve 2.60 binds
    its gRPC proxy and each replica's inter-deployment gRPC server to `[::]` (no setting moves them),
    and without Ray's token those servers unpickle whatever reaches them."""
    if ray_token_auth_on():
        return
    mode = os.environ.get("RAY_AUTH_MODE")
    why = f"RAY_AUTH_MODE={mode}" if mode is not None else "this Ray has no token authentication"
    raise RefusedToStart(
        f"refusing to start while Ray's token authentication is off ({why}): Serve's gRPC proxy and the gRPC "
        "server of every replica listen on every interface whatever --host says (Ray Serve has no setting to "
        "bind them to loopback), and without Ray's token those servers run code that anyone who reaches this "
        "machine sends them; the Ray dashboard and Ray's ports would run code for any local user. Unset "
        "RAY_AUTH_MODE (or set RAY_AUTH_MODE=token): Ray then creates a token in ~/.ray/auth_token"
    )


def api_key_env(ns: argparse.Namespace) -> str | None:
    """The environment variable the replicas read the API key from (None: no key)."""
    if ns.api_key_env:
        if not os.environ.get(ns.api_key_env):
            raise RefusedToStart(f"--api-key-env {ns.api_key_env}: that environment variable is not set")
        return ns.api_key_env
    if ns.api_key:  # only in argv: put it where the replicas read it
        print(f"warning: --api-key is visible to every local user (ps, /proc); set {API_KEY_ENV} or use "
              "--api-key-env NAME instead", file=sys.stderr, flush=True)
        os.environ[API_KEY_ENV] = ns.api_key
        return API_KEY_ENV
    return API_KEY_ENV if os.environ.get(API_KEY_ENV) else None


def use_single_machine_mode(ns: argparse.Namespace) -> None:
    """Ray on loopback only (see the module docstring); before Ray is imported in this process."""
    if not ns.public_metrics:
        if "ray" in sys.modules:
            raise RefusedToStart("Ray was imported before `mmserve serve` could keep it on loopback")
        os.environ[SINGLE_MACHINE_ENV] = "0"  # the cluster's processes inherit it


GRPC_MESSAGE_ENV = "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"  # Serve's gRPC proxy (2 GiB unless set), read at its start


def limit_grpc_messages(max_request_bytes: int) -> int:
    """Serve's gRPC proxy receives a whole message before the Router sees it (and checks the API
    key): cap a message at the largest request the app takes (`limits.max_request_bytes`) plus
    1 MiB of protobuf framing, instead of Serve's 2 GiB. The cluster's processes inherit it."""
    limit = max_request_bytes + (1 << 20)
    os.environ[GRPC_MESSAGE_ENV] = str(limit)
    return limit


def request_bytes_limit(app_args: dict | None) -> int:
    """An mmserve application's `limits.max_request_bytes` in a Serve config (its default when the
    args do not validate: the deploy then reports why)."""
    from pydantic import ValidationError

    from deployments.config import AppArgs, LimitArgs

    try:
        return AppArgs.model_validate(app_args or {}).limits.max_request_bytes
    except ValidationError:
        return LimitArgs().max_request_bytes


def plan_ingress(mode: str, host: str, port: int, per_client: int, max_body_bytes: int):
    """(host, port) for Serve's http_options, and the request cap (`HeaderCap`) to start in front of it
    (or None); sets Serve's ingress environment (before Ray is imported). RefusedToStart for `direct`
    beyond loopback, and for `proxy` beyond loopback without
    HAProxy; on loopback without HAProxy, a warning and no cap. The cap closes connections of one source
    address beyond `per_client` and refuses bodies over `max_body_bytes` (ingress_modes)."""
    from deployments.cli.ingress_modes import EXPERIMENTAL, HeaderCap, environ_for, free_loopback_port, haproxy_binary
    from deployments.config import is_loopback

    beyond = not is_loopback(host)
    if mode == "direct" and beyond:
        raise RefusedToStart(
            f"refusing --ingress direct on {host}: the Router replicas would listen there themselves, and their "
            "HTTP server bounds no header size (a few requests with 100 MB headers stall the app). Keep it on "
            "127.0.0.1 behind a proxy that caps headers, or use --ingress proxy (a request cap in front)")
    environ_for(mode)
    if mode in EXPERIMENTAL:
        print(f"ingress {mode}: experimental in Ray Serve 2.60", file=sys.stderr, flush=True)
    if mode != "proxy":
        return host, port, None
    try:
        haproxy_binary()  # found now, not after the app is up
    except FileNotFoundError as e:
        if beyond:
            raise RefusedToStart(f"refusing to listen on {host} without a header cap in front of Serve's proxy: {e}. "
                                 "Or keep --host on 127.0.0.1 behind a proxy of yours that caps headers") from None
        print(f"warning: {e}: Serve's proxy listens on {host}:{port} itself, with no request cap in front (no "
              "connection cap per client, header cap or request deadline: one local client can stall it)",
              file=sys.stderr, flush=True)
        return host, port, None
    upstream = free_loopback_port()
    return "127.0.0.1", upstream, HeaderCap(host, port, upstream, per_client, max_body_bytes)


def ingress_line(mode: str, cap) -> str:
    from deployments.cli.ingress_modes import DIRECT_PORTS, HEADER_CAP_BYTES, HEADER_DEADLINE_S

    if cap is not None:
        clients = f"{cap.per_client} connections per client" if cap.per_client else "no connection cap per client"
        return (f"ingress proxy behind a request cap: headers {HEADER_CAP_BYTES // 1024} KiB, {HEADER_DEADLINE_S} s "
                f"to send them and the body's first {HEADER_CAP_BYTES // 1024} KiB, {clients}")
    return (f"ingress direct: the Router replicas listen on {DIRECT_PORTS}, from the first" if mode == "direct"
            else f"ingress {mode}")


class StopSignal:
    """SIGTERM (docker stop, Kubernetes) and SIGINT (Ctrl-C), recorded from the start of the command
    (`install` again after `ray.init`, which sets a SIGTERM handler of its own)."""

    def __init__(self):
        self.received: list[int] = []
        self.install()

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._record)
        signal.signal(signal.SIGINT, self._record)  # also where a parent left SIGINT ignored

    def _record(self, signum, _frame) -> None:
        self.received.append(signum)

    @property
    def name(self) -> str | None:
        return signal.Signals(self.received[0]).name if self.received else None


def start_ray(ns: argparse.Namespace, stop: StopSignal):
    """The embedded cluster's head (`deployments.cli.ray_head`), this process its driver; None when a
    signal came first. RayStartFailed says why it did not start."""
    from deployments.cli.ray_head import HeadSpec, start_head

    spec = HeadSpec(num_cpus=ns.num_cpus, dashboard=ns.dashboard, dashboard_host=ns.dashboard_host)
    try:
        head = start_head(spec, stopped=lambda: bool(stop.received), log_to_driver=True, logging_level="WARNING")
    except SystemExit as e:  # SIGTERM while connecting to the head: the handler ray.init sets exits
        if e.code != signal.SIGTERM:
            raise
        stop.received.append(signal.SIGTERM)
        return None
    finally:
        stop.install()  # ours again, in place of the one ray.init sets
    if head is not None and head.dashboard_url:
        auth = f"token auth on: the token is in {token_location()}" if ray_token_auth_on() else "no token auth"
        print(f"Ray dashboard: http://{head.dashboard_url} ({auth}; Serve tab: deployments, replicas, logs)",
              flush=True)
    return head


def check_on_node(args) -> None:
    """`args` resolved here as each replica resolves them (`AppArgs.on_node`), before Ray starts:
    RefusedToStart naming what does not fit (`--max-model-len` over the checkpoint's context)."""
    try:
        args.on_node(api_key=False)
    except (OSError, ValueError) as e:
        raise RefusedToStart(str(e).replace("engine.max_model_len", "--max-model-len")) from None


def stop_during_startup(stop: StopSignal) -> int:
    """Nothing was served yet: no drain, the embedded cluster goes down with every replica in it (the
    caller stops the head)."""
    print(f"{stop.name} during start-up: stopping", flush=True)
    return 0


def wait_until_serving(app_names: list[str], stop: StopSignal, asked: list[str] | None = None) -> bool:
    """Until every app is RUNNING (every replica constructed: models loaded and warmed up) and the
    mmserve apps among them (`asked`, default all) answer ready (`Router.unavailable`, what
    `/health` says), or a signal came (False). RuntimeError when an app failed to deploy."""
    from ray import serve

    from deployments.serve.router import app_unavailable

    asked = app_names if asked is None else asked
    print("waiting for the replicas to load their models and warm up (Ctrl-C to stop) ...", flush=True)
    while not stop.received:
        running = serve.status().applications
        statuses = {name: running.get(name) for name in app_names}
        failed = {n: a.message for n, a in statuses.items() if a is not None and a.status == "DEPLOY_FAILED"}
        if failed:
            raise RuntimeError("; ".join(f"application {n} failed to deploy: {m}" for n, m in failed.items()))
        if all(a is not None and a.status == "RUNNING" for a in statuses.values()):
            with contextlib.suppress(TimeoutError):
                if all(app_unavailable(name, timeout_s=1.0) is None for name in asked):
                    return True
        time.sleep(0.25)
    return False


DEFAULT_GRPC_PORT = 9000
NO_KEY_GRPC_WARNING = (
    "warning: no API key, and Serve's gRPC proxy listens on every interface (port {port}){direct} whatever --host "
    "says: anyone who reaches this machine can call the model there. Set MMSERVE_API_KEY, or firewall the port")


def public_grpc_port(key_env: str | None, asked: int | None, ingress: str) -> int | None:
    """The port of Serve's gRPC proxy, the public gRPC API (None: not started). Serve binds it to every
    interface whatever --host says, so without an API key it starts only when `--grpc-port` asks for it,
    and then with a warning; with a key, on `--grpc-port` or 9000."""
    if key_env is not None:
        return DEFAULT_GRPC_PORT if asked is None else asked
    if asked is None:
        print("no API key: Serve's gRPC proxy is not started (it would listen on every interface, whatever --host "
              "says); --grpc-port PORT starts it", file=sys.stderr, flush=True)
        return None
    direct = " and the Router replicas' direct gRPC ports (40000-41000)" if ingress == "direct" else ""
    print(NO_KEY_GRPC_WARNING.format(port=asked, direct=direct), file=sys.stderr, flush=True)
    return asked


def serve_app(ns: argparse.Namespace) -> int:
    start = time.perf_counter()
    check_ray_token_auth()
    key_env = api_key_env(ns)
    grpc_port = public_grpc_port(key_env, ns.grpc_port, ns.ingress)
    serve_host, serve_port, cap = plan_ingress(ns.ingress, ns.host, ns.http_port, ns.max_connections_per_client,
                                               request_bytes_limit(None))
    use_single_machine_mode(ns)
    stop = StopSignal()
    from ray import serve

    from deployments.serve.app import build_app
    from deployments.serve.router import grpc_options

    app_args(ns, key_env)  # flags that do not go together are refused before anything is built
    model_dir = ns.model
    if model_dir is None:
        from mmserve.tiny import default_model_dir, ensure_tiny_model

        print(f"building the embedded tiny model into {default_model_dir()} (once) ...", flush=True)
        model_dir = str(ensure_tiny_model())
    args = app_args(ns, key_env, gpu_shares(ns, model_dir))
    check_on_node(args)
    if stop.received:
        return stop_during_startup(stop)

    def deploy() -> tuple[list[str], list[str], str]:
        serve.start(http_options={"host": serve_host, "port": serve_port},
                    grpc_options=grpc_options(port=grpc_port) if grpc_port else None)
        serve.run_many([serve.RunTarget(build_app(args), name="mmserve", route_prefix="/")],
                       wait_for_applications_running=False)
        grpc = f"gRPC mmserve.v1.VLMService on port {grpc_port}" if grpc_port else "no gRPC (no API key)"
        return ["mmserve"], ["mmserve"], (f": http://{ns.host}:{ns.http_port}/v1/chat/completions, {grpc}"
                                          f"{f' (API key from {key_env})' if key_env else ''}; "
                                          f"{ingress_line(ns.ingress, cap)} (Ctrl-C to stop)")

    return serve_on_ray(ns, stop, cap, args.limits.max_request_bytes, start, deploy)


def gpu_shares(ns: argparse.Namespace, model_dir: str):
    """`--encoder-gpus` / `--llm-gpus` where they are not given, on a host with GPUs with `--device`
    auto or cuda: chosen by `choose_gpu_shares` for the checkpoint's weights and said; None when
    there is nothing to choose (no GPU seen, `--device cpu`, both flags given). RefusedToStart when
    the models do not fit the GPUs."""
    from deployments.cli.gpu_shares import GpuShares, choose_gpu_shares, visible_gpu_memory
    from llm_service.model.language_model import weight_split

    if ns.device == "cpu" or (ns.encoder_gpus is not None and ns.llm_gpus is not None):
        return None
    memory = visible_gpu_memory()
    if not memory:
        return None
    llm_bytes, encoder_bytes = weight_split(model_dir, ns.dtype)
    try:
        chosen = choose_gpu_shares(len(memory), min(memory), encoder_bytes, llm_bytes, ns.tensor_parallel_size)
    except ValueError as e:
        raise RefusedToStart(str(e)) from None
    shares = GpuShares(chosen.encoder if ns.encoder_gpus is None else ns.encoder_gpus,
                       chosen.llm if ns.llm_gpus is None else ns.llm_gpus, chosen.why)
    print(f"GPU shares: encoder {shares.encoder:g}, LLM {shares.llm:g} ({shares.why}; --encoder-gpus / "
          "--llm-gpus to choose)", flush=True)
    return shares


def app_args(ns: argparse.Namespace, key_env: str | None, shares=None):
    """`AppArgs` from `mmserve serve`'s app flags (without --config), with the GPU shares chosen
    (`gpu_shares`; None: the flags, unset ones 0); RefusedToStart names the flags that do not go
    together (`--tensor-parallel-size` with a fractional `--llm-gpus`)."""
    from pydantic import ValidationError

    from deployments.config import AppArgs, EngineArgs

    cpus, ranks = ns.num_cpus, ns.tensor_parallel_size
    encoder_gpus, llm_gpus = shares[:2] if shares else (ns.encoder_gpus or 0, ns.llm_gpus or 0)
    try:
        return AppArgs(
            model=ns.model, dtype=ns.dtype, device=ns.device, api_key_env=key_env,
            # (given in part: the deployments' other defaults stay)
            router={"num_cpus": 0.25 * cpus},
            encoder={"num_cpus": 0.25 * cpus, "num_gpus": encoder_gpus},
            # a tensor-parallel replica's ranks share the LLM's quarter (each rank reserves its part)
            llm={"num_cpus": 0.25 * cpus / ranks, "num_gpus": llm_gpus},
            video_decoder={"num_cpus": 0.125 * cpus},
            engine=EngineArgs(max_model_len=ns.max_model_len, tensor_parallel_size=ranks),
            lora_modules=dict(ns.lora),
        )
    except ValidationError as e:
        flags = {"tensor_parallel_size": "--tensor-parallel-size", "llm.num_gpus": "--llm-gpus"}
        message = "; ".join(error["msg"].removeprefix("Value error, ") for error in e.errors())
        for field, flag in flags.items():
            message = message.replace(f"engine.{field}", flag).replace(field, flag)
        raise RefusedToStart(message) from None


def config_with_flags(raw: dict, path: str, host: str | None, key_env: str | None,
                      flag: str | None, http_port: int | None = None,
                      grpc_port: int | None = None) -> tuple[dict, list[str]]:
    """The Serve config `raw` (read from `path`) with the command line applied, and a line per
    application saying where its API key comes from.

    `--host` (`host`) replaces `http_options.host` (127.0.0.1 when both are silent), `--http-port`
    `http_options.port`, `--grpc-port` `grpc_options.port` (refused, naming the flag, when the file
    serves no gRPC: no `grpc_options.grpc_servicer_functions`). The key, in
    environment variable `key_env` (named by `flag`, or MMSERVE_API_KEY set in the environment
    when `flag` is None), goes to every application as `api_key_env`. An application that names its
    own key (`api_key`, `api_key_env`) keeps it when the key came from the environment; a flag naming
    another key is refused, as is any key for an application mmserve does not build (it could not
    take one): RefusedToStart names the flag and the application. Without a key for every application,
    the file's gRPC proxy (every interface, whatever `--host` says) starts only when `--grpc-port` asks
    for it, then with a warning line (`public_grpc_port`)."""
    config = copy.deepcopy(raw)
    http = config.get("http_options") or {}
    config["http_options"] = {**http, "host": host or http.get("host", "127.0.0.1")}
    if http_port is not None:
        config["http_options"]["port"] = http_port
    if grpc_port is not None:
        grpc = config.get("grpc_options") or {}
        if not grpc.get("grpc_servicer_functions"):
            raise RefusedToStart(f"--grpc-port {grpc_port}: {path} serves no gRPC (its grpc_options name no "
                                 "grpc_servicer_functions); drop the flag, or set grpc_options in the file")
        config["grpc_options"] = {**grpc, "port": grpc_port}
    if key_env is None:
        keyless = [app.get("name", "default") for app in config.get("applications") or []
                   if not any((app.get("args") or {}).get(k) for k in ("api_key", "api_key_env"))]
        serves_grpc = bool((config.get("grpc_options") or {}).get("grpc_servicer_functions"))
        if not (keyless and serves_grpc):
            return config, []
        names = ", ".join(repr(name) for name in keyless)
        if grpc_port is None:
            del config["grpc_options"]
            return config, [f"no API key for application {names}: the file's gRPC proxy is not started (it would "
                            "listen on every interface, whatever --host says); --grpc-port PORT starts it"]
        return config, [NO_KEY_GRPC_WARNING.format(port=grpc_port, direct="") + f" (application {names})"]
    source = flag or f"{key_env} (set in the environment)"
    lines = []
    for app in config.get("applications") or []:
        name = app.get("name", "default")
        if app.get("import_path") not in APP_IMPORT_PATHS:
            raise RefusedToStart(
                f"{source}: application {name!r} in {path} is not mmserve's (import_path {app.get('import_path')}), "
                "so it cannot take the API key and would serve without one; serve it from a config of its own"
                + ("" if flag else f", or unset {key_env}"))
        args = app["args"] = dict(app.get("args") or {})
        own = (f"api_key_env: {args['api_key_env']}" if args.get("api_key_env")
               else "api_key" if args.get("api_key") is not None else None)
        if own is None:
            args["api_key_env"] = key_env
            lines.append(f"application {name!r}: API key from {source}")
        elif args.get("api_key_env") == key_env:
            lines.append(f"application {name!r}: API key from {key_env} (its {own} in {path})")
        elif flag:
            raise RefusedToStart(f"{flag}: application {name!r} in {path} already names its key ({own}); "
                                 "drop the flag or the key in the file")
        else:
            lines.append(f"application {name!r}: API key from its own {own} in {path}, not {key_env}")
    return config, lines


def serve_config(ns: argparse.Namespace) -> int:
    """The Serve config file `serve run` / `serve deploy` / KubeRay's serveConfigV2 take: the same
    controller builds the apps; every app setting comes from the file, but for the listening host,
    the ports and the API key (`config_with_flags`)."""
    import yaml

    start = time.perf_counter()
    check_ray_token_auth()
    # the flag that gave the key (None: none, or MMSERVE_API_KEY from the environment)
    flag = f"--api-key-env {ns.api_key_env}" if ns.api_key_env else "--api-key" if ns.api_key else None
    with open(ns.config) as f:
        raw, key_lines = config_with_flags(yaml.safe_load(f), ns.config, ns.host, api_key_env(ns), flag,
                                           ns.http_port, ns.grpc_port)
    for line in key_lines:
        print(line, flush=True)
    http_options = raw["http_options"]
    max_body = max([request_bytes_limit(app.get("args")) for app in raw.get("applications") or []
                    if app.get("import_path") in APP_IMPORT_PATHS], default=request_bytes_limit(None))
    serve_host, serve_port, cap = plan_ingress(ns.ingress, http_options["host"], http_options.get("port", 8000),
                                               ns.max_connections_per_client, max_body)
    use_single_machine_mode(ns)
    stop = StopSignal()
    from ray import serve
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    config = ServeDeploySchema.model_validate(raw)
    http = config.http_options

    def deploy() -> tuple[list[str], list[str], str]:
        options = config.model_dump(include={"proxy_location", "http_options", "grpc_options"}, exclude_unset=True)
        options["http_options"] = {**options.get("http_options", {}), "host": serve_host, "port": serve_port}
        serve.start(**options)
        _get_global_client().deploy_apps(config)
        names = [app.name for app in config.applications]
        ours = [app.name for app in config.applications if app.import_path in APP_IMPORT_PATHS]
        return names, ours, (f" from {ns.config}: http://{http.host}:{http.port} ({', '.join(names)}; "
                             f"{ingress_line(ns.ingress, cap)}; Ctrl-C to stop)")

    return serve_on_ray(ns, stop, cap, max_body, start, deploy)


def serve_on_ray(ns: argparse.Namespace, stop: StopSignal, cap, max_request_bytes: int, start: float,
                 deploy: Callable[[], tuple[list[str], list[str], str]]) -> int:
    """The embedded cluster started (`start_ray`; Serve's gRPC messages capped: `limit_grpc_messages`)
    and `deploy()` on it: (its apps, mmserve's among them, where they listen, for the ready line). Once
    they serve (`wait_until_serving`) "mmserve ready" and served until a signal; a signal first stops
    everything (exit 0), a failed deploy exits 1; Ray is stopped last."""
    from ray import serve

    limit_grpc_messages(max_request_bytes)
    head = start_ray(ns, stop)
    if head is None or stop.received:
        return stop_during_startup(stop)
    try:
        app_names, ours, where = deploy()
        try:
            serving = wait_until_serving(app_names, stop, ours)
        except RuntimeError as e:
            print(e, file=sys.stderr)
            serve.shutdown()
            return 1
        if not serving:
            serve.shutdown()
            return stop_during_startup(stop)
        if cap is not None:
            cap.start()
        print(f"mmserve ready in {time.perf_counter() - start:.1f}s{where}", flush=True)
        return serve_until_signal(app_names, ns.grace_period, stop, cap)
    finally:
        head.stop()


def serve_until_signal(app_names: list[str], grace_s: float, stop: StopSignal, cap=None) -> int:
    """Serve until SIGTERM (docker stop, Kubernetes) or Ctrl-C, then drain and stop cleanly:
    new requests get 503 / UNAVAILABLE, requests in flight finish (up to `grace_s`), then Serve
    shuts down (Ray after it, by the caller) and the command exits 0."""
    from ray import serve

    from deployments.serve.drain import drain

    while not stop.received:
        time.sleep(0.2)
    print(f"{stop.name}: draining (new requests get 503; up to {grace_s:g}s for requests in flight)", flush=True)
    if left := drain(app_names, grace_s):
        print(f"grace period over with {left} requests in flight", flush=True)
    print("shutting down", flush=True)
    if cap is not None:  # after the drain: it forwarded the drain's 503s
        cap.stop()
    serve.shutdown()
    return 0
