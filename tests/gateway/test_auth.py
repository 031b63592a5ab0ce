"""API keys on a real gateway (scripted compute, in-memory store): who gets in, what each key may do,
its rate and stream limits, the HTTP API's same checks, and keys never in a log line."""
from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import logging
from dataclasses import dataclass

import grpc
import pytest

from loraplex.client import AsyncClient, Lora
from loraplex.model_files import resolve_model_path
from loraplex.settings import SettingsError, settings_from_args
from loraplex.v1 import compute_pb2_grpc, gateway_pb2_grpc
from gateway.api_keys import KeyEntry, format_entry, hash_key, load_key_file, load_keys
from gateway.auth import AccessControl, AuthInterceptor, Limits, access_from_config, http_guard
from gateway.config import GatewayConfig
from gateway.http.app import http_server_for
from gateway.router import SingleReplicaRouter
from gateway.server import build_servicer
from gateway.tls import credentials_from_config
from gateway_fakes import ScriptedCompute, grpc_server
from gateway_harness import MemoryStore, random_adapter, smollm2_spec

pytestmark = pytest.mark.timeout(120)

ADMIN, ALICE, READER, SLOW = ("lpx-admin-" + "a" * 30, "lpx-alice-" + "b" * 30, "lpx-reader-" + "c" * 30,
                              "lpx-slow-" + "d" * 30)
WRONG = "lpx-wrong-" + "e" * 30
USER = "lpx-user-" + "g" * 30
ENTRIES = [
    KeyEntry("admin", hash_key(ADMIN), manage=True),
    KeyEntry("alice", hash_key(ALICE), adapters=("alice-",), manage=True),
    KeyEntry("reader", hash_key(READER), adapters=("alice-",)),
    KeyEntry("slow", hash_key(SLOW), rate=0.01, burst=2, max_streams=1),
    KeyEntry("user", hash_key(USER)),
]


@dataclass
class AuthStack:
    address: str
    store: MemoryStore
    http_port: int
    tls: bool

    def client(self, key: str | None, **kw) -> AsyncClient:
        return AsyncClient(self.address, timeout=20, api_key=key, **kw)


@contextlib.asynccontextmanager
async def auth_stack(tokenizer, *, keys_file: str = "", delay_s: float = 0.0, http: bool = False, **config):
    """A gateway as `gateway.server.serve` builds it (interceptors, TLS, HTTP guard from the settings),
    over scripted compute and an in-memory store."""
    compute = ScriptedCompute(tokenizer, max_model_len=256, delay_s=delay_s)
    store = MemoryStore(smollm2_spec())
    async with contextlib.AsyncExitStack() as stack:
        compute_address = await stack.enter_async_context(
            grpc_server(lambda s: compute_pb2_grpc.add_ComputeServicer_to_server(compute, s)))
        cfg = GatewayConfig(compute_addresses=(compute_address,), max_message_bytes=64 << 20,
                            api_keys_file=keys_file, http_listen="127.0.0.1:0" if http else "", **config)
        router = SingleReplicaRouter(compute_address, cfg.max_message_bytes)
        stack.push_async_callback(router.close)
        servicer = build_servicer(cfg, tokenizer, smollm2_spec(), store, router)
        access = access_from_config(cfg)
        server = grpc.aio.server(interceptors=[AuthInterceptor(access)])
        gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, server)
        from grpc_health.v1 import health, health_pb2_grpc
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        creds = credentials_from_config(cfg)
        port = (server.add_secure_port("127.0.0.1:0", creds) if creds
                else server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        stack.push_async_callback(server.stop, 0)
        http_port = 0
        if http:
            web = http_server_for(cfg, servicer, resolve_model_path(""), guard=http_guard(access))
            http_port = int(web.bind().rsplit(":", 1)[1])
            await web.start()
            stack.push_async_callback(web.stop)
        yield AuthStack(f"127.0.0.1:{port}", store, http_port, creds is not None)


@pytest.fixture
def keys_file(tmp_path):
    path = tmp_path / "keys.toml"
    path.write_text("\n".join(format_entry(e, "toml") for e in ENTRIES))
    return str(path)


async def call_code(coro) -> grpc.StatusCode:
    try:
        await coro
    except Exception as exc:  # noqa: BLE001 - the status is what the test looks at
        code = getattr(exc, "grpc_code", None)
        assert isinstance(code, grpc.StatusCode), exc
        return code
    return grpc.StatusCode.OK


def test_no_key_or_a_wrong_key_is_unauthenticated_health_stays_open(tokenizer, keys_file):
    async def go():
        async with auth_stack(tokenizer, keys_file=keys_file) as st:
            codes = {}
            for label, key in (("none", None), ("wrong", WRONG), ("admin", ADMIN)):
                async with st.client(key) as c:
                    codes[label] = (await call_code(c.generate("hi", max_tokens=2)),
                                    await call_code(c.list_loras()), await call_code(c.model_info()))
            async with grpc.aio.insecure_channel(st.address) as ch:      # not a Bearer scheme
                stub = gateway_pb2_grpc.GatewayStub(ch)
                from loraplex.v1 import gateway_pb2
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.ListLoras(gateway_pb2.ListLorasRequest(), metadata=(("authorization", ADMIN),))
                from grpc_health.v1 import health_pb2, health_pb2_grpc
                health_status = (await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())).status
            return codes, err.value, health_status
    codes, err, health_status = asyncio.run(go())
    unauth = grpc.StatusCode.UNAUTHENTICATED
    assert codes["none"] == (unauth,) * 3 and codes["wrong"] == (unauth,) * 3
    assert codes["admin"] == (grpc.StatusCode.OK,) * 3
    assert err.code() == unauth and "Bearer" in err.details() and ADMIN not in err.details()
    assert health_status == 1   # SERVING, without a key


def test_scopes_adapter_prefixes_and_management(tokenizer, keys_file):
    async def go():
        async with auth_stack(tokenizer, keys_file=keys_file) as st:
            w, c = random_adapter(seed=1)
            out = {}
            async with st.client(ADMIN) as admin, st.client(ALICE) as alice, st.client(READER) as reader:
                await admin.load_lora(task_id=1, name="alice-a", weights=w, config=c)
                await admin.load_lora(task_id=2, name="bob-b", weights=w, config=c)
                out["alice own"] = await call_code(alice.generate("q", lora="alice-a", max_tokens=2))
                out["alice base"] = await call_code(alice.generate("q", max_tokens=2))
                out["alice other"] = await call_code(alice.generate("q", lora="bob-b", max_tokens=2))
                out["alice task id"] = await call_code(alice.generate("q", lora=1, max_tokens=2))
                out["alice fan-out"] = await call_code(alice.fan_out("q", [None, "alice-a", "bob-b"], max_tokens=2))
                out["alice load own"] = await call_code(alice.load_lora(task_id=3, name="alice-c", weights=w,
                                                                        config=c))
                out["alice load other"] = await call_code(alice.load_lora(task_id=4, name="bob-d", weights=w,
                                                                          config=c))
                out["alice unload by id"] = await call_code(alice.unload_lora(task_id=2))
                out["reader generate"] = await call_code(reader.generate("q", lora="alice-a", max_tokens=2))
                out["reader load"] = await call_code(reader.load_lora(task_id=5, name="alice-e", weights=w, config=c))
                out["reader unload"] = await call_code(reader.unload_lora(name="alice-a"))
                listed = {a.name for a in (await reader.list_loras()).adapters}
                everything = {a.name for a in (await admin.list_loras()).adapters}
                out["admin unload"] = await call_code(admin.unload_lora(name="bob-b"))
                async with st.client(USER) as user:      # every adapter, no management
                    out["user task id"] = await call_code(user.generate("q", lora=1, max_tokens=2))
                    out["user inline"] = await call_code(user.generate(
                        "q", lora=Lora(task_id=1, weights=w, config=c, load_mode="always"), max_tokens=2))
            return out, listed, everything, st.store
    out, listed, everything, store = asyncio.run(go())
    ok, denied = grpc.StatusCode.OK, grpc.StatusCode.PERMISSION_DENIED
    assert out == {"alice own": ok, "alice base": ok, "alice other": denied, "alice task id": denied,
                   "alice fan-out": denied, "alice load own": ok, "alice load other": denied,
                   "alice unload by id": denied, "reader generate": ok, "reader load": denied,
                   "reader unload": denied, "admin unload": ok, "user task id": ok, "user inline": denied}
    assert listed == {"alice-a", "alice-c"} and everything == {"alice-a", "alice-c", "bob-b"}


def test_rate_and_stream_limits_answer_resource_exhausted(tokenizer, keys_file):
    async def go():
        async with auth_stack(tokenizer, keys_file=keys_file) as st:
            async with st.client(SLOW) as slow, st.client(ADMIN) as admin:
                # burst 2 at 0.01/s (no refill in a slow run): two pass, the third is refused; other keys unaffected
                rate = [await call_code(slow.model_info()) for _ in range(3)]
                other = await call_code(admin.model_info())
                try:
                    await slow.model_info()
                except Exception as exc:  # noqa: BLE001
                    message = str(exc)
        # the gateway's default stream limit, for a key from LORAPLEX_API_KEYS
        async with auth_stack(tokenizer, delay_s=0.05, api_keys=ADMIN, api_key_max_streams=1) as st:
            async with st.client(ADMIN) as c:
                first = c.stream("q", max_tokens=30)
                await anext(first)                                  # one stream open
                second = await call_code(c.generate("q", max_tokens=2))
                rest = [chunk async for chunk in first]             # it ends: its slot is free again
                third = await call_code(c.generate("q", max_tokens=2))
        return rate, other, message, second, rest[-1].finish_reason, third
    rate, other, message, second, finish, third = asyncio.run(go())
    ok, exhausted = grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED
    assert rate == [ok, ok, exhausted] and other == ok
    assert "'slow'" in message and "rate" in message and SLOW not in message
    assert second == exhausted and finish == "stop" and third == ok


def test_http_api_takes_the_same_keys_scopes_and_limits(tokenizer, keys_file):
    def post(port: int, path: str, body: dict, key: str | None) -> tuple[int, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
        headers = {"content-type": "application/json"} | ({"authorization": f"Bearer {key}"} if key else {})
        conn.request("POST" if body else "GET", path, json.dumps(body) if body else None, headers)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"{}")

    async def go():
        async with auth_stack(tokenizer, keys_file=keys_file, http=True) as st:
            w, c = random_adapter(seed=2)
            async with st.client(ADMIN) as admin:
                await admin.load_lora(task_id=1, name="bob-b", weights=w, config=c)
            p = st.http_port
            done = {}
            for label, path, body, key in (
                    ("no key", "/v1/models", None, None),
                    ("wrong key", "/v1/completions", {"model": "bob-b", "prompt": "q", "max_tokens": 2}, WRONG),
                    ("out of scope", "/v1/completions", {"model": "bob-b", "prompt": "q", "max_tokens": 2}, ALICE),
                    ("no manage", "/v1/load_lora_adapter", {"lora_name": "alice-x", "lora_path": "x"}, READER),
                    ("admin", "/v1/completions", {"model": "bob-b", "prompt": "q", "max_tokens": 2}, ADMIN)):
                done[label] = await asyncio.to_thread(post, p, path, body, key)
            models = await asyncio.to_thread(post, p, "/v1/models", None, ALICE)
            # the gRPC calls of 'slow' and its HTTP calls share one bucket
            async with st.client(SLOW) as slow:
                await slow.model_info()
                await slow.model_info()
            limited = await asyncio.to_thread(post, p, "/v1/models", None, SLOW)
            return done, models, limited
    done, models, limited = asyncio.run(go())
    assert {k: v[0] for k, v in done.items()} == {"no key": 401, "wrong key": 401, "out of scope": 403,
                                                   "no manage": 403, "admin": 200}
    assert done["no key"][1]["error"]["type"] == "authentication_error"
    assert "bob-b" not in {m["id"] for m in models[1]["data"]}
    assert limited[0] == 429


def test_keys_never_reach_the_logs(tokenizer, keys_file, caplog):
    caplog.set_level(logging.DEBUG)

    async def go():
        async with auth_stack(tokenizer, keys_file=keys_file, api_keys=ADMIN.replace("admin", "envkey")) as st:
            for key in (WRONG, ADMIN, ALICE, SLOW, SLOW, SLOW, None):
                async with st.client(key) as c:
                    await call_code(c.generate("q", lora="bob-b", max_tokens=2))
                    await call_code(c.load_lora(task_id=9, name="bob-z", path="nowhere"))
    asyncio.run(go())
    cfg = GatewayConfig(api_keys="lpx-secret-from-env-0123456789")
    assert "lpx-secret" not in repr(cfg)
    text = caplog.text
    assert "refused" in text      # refusals are logged, by entry name
    for key in (ADMIN, ALICE, SLOW, WRONG, ADMIN.replace("admin", "envkey")):
        assert key not in text and key[-20:] not in text


@pytest.mark.parametrize("suffix", [".toml", ".json", ".txt"])
def test_key_file_formats_round_trip(tmp_path, suffix):
    entries = ENTRIES + [KeyEntry("base-only", hash_key("lpx-" + "f" * 30), adapters=())]
    path = tmp_path / f"keys{suffix}"
    lines = [format_entry(e, {".toml": "toml", ".json": "json"}.get(suffix, "line")) for e in entries]
    if suffix == ".json":
        path.write_text(json.dumps({"keys": [json.loads(x) for x in lines]}))
    else:
        path.write_text("# who may call\n" + "\n".join(lines) + "\n")
    assert load_key_file(path) == entries
    assert ADMIN not in path.read_text()


def test_cli_keys_add_appends_a_hashed_entry_and_prints_the_key_once(tmp_path, capsys):
    from loraplex.cli.main import main
    path = tmp_path / "keys.txt"
    assert main(["keys", "add", "--file", str(path), "--name", "ci", "--adapters", "ci-", "--rate", "3"]) == 0
    key = capsys.readouterr().out.strip()
    assert key.startswith("lpx-") and len(key) > 40 and key not in path.read_text()
    assert (path.stat().st_mode & 0o777) == 0o600
    [entry] = load_key_file(path)
    assert entry == KeyEntry("ci", hash_key(key), adapters=("ci-",), rate=3.0)
    assert main(["keys", "add", "--file", str(path), "--name", "ci"]) == 2      # a name once


def test_env_keys_hashed_on_load_and_bad_settings_refused(tmp_path):
    cfg = settings_from_args(GatewayConfig, environ={"LORAPLEX_API_KEYS": f"{ADMIN}, {hash_key(ALICE)}"})
    access = access_from_config(cfg)
    assert access.key_names() == ["env-1", "env-2"]
    assert access.authorize(ALICE, "/loraplex.v1.Gateway/LoadLora").manage
    with pytest.raises(SettingsError, match="shorter than 16"):
        load_keys("", "short")
    bad = tmp_path / "keys.txt"
    bad.write_text(f"ok {hash_key(ADMIN)}\nbroken sha256:1234\n")
    with pytest.raises(SettingsError, match="keys.txt:2"):
        GatewayConfig(api_keys_file=str(bad))
    bad.write_text(f"a {hash_key(ADMIN)}\nb {hash_key(ADMIN)}\n")
    with pytest.raises(SettingsError, match="twice"):
        access_from_config(GatewayConfig(api_keys_file=str(bad)))


def test_token_bucket_refills_at_its_rate():
    now = [0.0]
    access = AccessControl([KeyEntry("k", hash_key(SLOW), rate=2.0, burst=1)], Limits(), clock=lambda: now[0])
    access.authorize(SLOW, "generate")
    with pytest.raises(Exception, match="retry in 0.50 s"):
        access.authorize(SLOW, "generate")
    now[0] = 0.5
    access.authorize(SLOW, "generate")


def test_startup_warns_when_a_public_address_is_open_or_in_clear(caplog):
    from gateway.auth import is_loopback, warn_if_exposed
    assert is_loopback("127.0.0.1:50051") and is_loopback("[::1]:1") and is_loopback("localhost:1")
    assert not is_loopback("0.0.0.0:50051") and not is_loopback("[::]:1") and not is_loopback("gateway:1")
    open_, keyed = AccessControl([]), AccessControl(ENTRIES)
    caplog.set_level(logging.WARNING)
    warn_if_exposed("127.0.0.1:50051", open_, tls=False)
    assert caplog.text == ""
    warn_if_exposed("0.0.0.0:50051", open_, tls=False)
    assert "no API keys" in caplog.text
    caplog.clear()
    warn_if_exposed("0.0.0.0:50051", keyed, tls=False)
    assert "without TLS" in caplog.text
    caplog.clear()
    warn_if_exposed("0.0.0.0:50051", keyed, tls=True)
    assert caplog.text == ""
