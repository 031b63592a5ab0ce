"""Property-based fuzzing of every public Gateway RPC against a real gateway server.

Every input, however hostile (huge or odd-unicode strings, negative or huge
numbers, malformed inline tensors, many fan-out entries), must get OK or a
status other than INTERNAL whose message is at most MAX_STATUS_MESSAGE
characters, and the server must answer a good request afterwards. One server
per test function; examples are derandomized so CI sees the same inputs.
"""
from __future__ import annotations

import asyncio
import contextlib
import threading

import grpc
from hypothesis import HealthCheck, given, settings, strategies as st

from loraplex.grpc_errors import MAX_STATUS_MESSAGE
from loraplex.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from gateway_harness import gateway_stack

FUZZ = settings(derandomize=True, max_examples=60, deadline=None, database=None,
                suppress_health_check=list(HealthCheck))
TIMEOUT_S = 20.0

texts = st.one_of(st.text(max_size=64), st.text(alphabet="\U0001F600\u200b\ud7ff\x00\ufffd\u0301", max_size=64),
                  st.integers(0, 20_000).map(lambda n: "x" * n))
u32 = st.one_of(st.integers(0, 64), st.sampled_from([2**31 - 1, 2**32 - 1]))
u64 = st.one_of(st.integers(0, 64), st.sampled_from([2**63 - 1, 2**64 - 1]))
floats = st.floats(allow_nan=True, allow_infinity=True, width=32)
dims = st.one_of(st.integers(-3, 8), st.sampled_from([-(2**63), 2**62, 2**63 - 1]))


@st.composite
def tensors(draw):
    shape = draw(st.lists(dims, max_size=4))
    data = draw(st.one_of(st.binary(max_size=256), st.integers(0, 1 << 20).map(lambda n: b"\x7f" * n)))
    return common_pb2.Tensor(dtype=draw(st.integers(-2, 7)), shape=shape, data=data)


optional_tensor = st.one_of(st.none(), tensors())


def with_id_and_tensors(draw, msg):
    """`msg` with, each maybe, a task id and inline weights and config tensors."""
    if draw(st.booleans()):
        msg.task_id = draw(u64)
    for field in ("weights", "config"):
        t = draw(optional_tensor)
        if t is not None:
            getattr(msg, field).CopyFrom(t)
    return msg


@st.composite
def lora_specs(draw):
    spec = common_pb2.LoraSpec(name=draw(texts), load_mode=draw(st.integers(-1, 4)))
    return with_id_and_tensors(draw, spec)


@st.composite
def sampling_params(draw):
    """Half of them valid, so that the other fields are reached instead of refused first."""
    if draw(st.booleans()):
        return common_pb2.SamplingParams(max_tokens=draw(st.integers(1, 8)), temperature=draw(st.sampled_from([0.0, 0.7])),
                                         stop=draw(st.lists(texts, max_size=2)),
                                         stop_token_ids=draw(st.lists(st.integers(0, 50_000), max_size=2)))
    return common_pb2.SamplingParams(
        max_tokens=draw(u32), temperature=draw(floats), top_k=draw(u32), top_p=draw(floats), seed=draw(u64),
        stop=draw(st.lists(texts, max_size=4)), stop_token_ids=draw(st.lists(u32, max_size=4)),
        ignore_eos=draw(st.booleans()))


@st.composite
def generate_requests(draw):
    many = st.integers(0, 300).map(lambda n: [common_pb2.LoraSpec(task_id=i % 5) for i in range(n)])
    prompt = draw(st.one_of(st.tuples(texts, st.just([])), st.tuples(st.just(""), st.lists(u32, max_size=40)),
                            st.tuples(texts, st.lists(u32, max_size=4))))
    return gateway_pb2.GenerateRequest(
        text=prompt[0], input_ids=prompt[1], loras=draw(st.one_of(st.just([]), st.lists(lora_specs(), max_size=3), many)),
        sampling=draw(sampling_params()), chat=draw(st.booleans()), request_id=draw(texts))


@st.composite
def load_requests(draw):
    req = gateway_pb2.LoadLoraRequest(name=draw(texts), path=draw(texts), replace=draw(st.booleans()))
    return with_id_and_tensors(draw, req)


@st.composite
def unload_requests(draw):
    req = gateway_pb2.UnloadLoraRequest(name=draw(texts))
    if draw(st.booleans()):
        req.task_id = draw(u64)
    return req


@contextlib.contextmanager
def live_gateway(tokenizer):
    """A real gateway stack on its own event loop thread; yields a blocking stub."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    cm = gateway_stack(tokenizer)
    stack = asyncio.run_coroutine_threadsafe(cm.__aenter__(), loop).result(60)
    channel = grpc.insecure_channel(stack.address, options=[("grpc.max_receive_message_length", 64 << 20),
                                                            ("grpc.max_send_message_length", 64 << 20)])
    try:
        yield gateway_pb2_grpc.GatewayStub(channel)
    finally:
        channel.close()
        asyncio.run_coroutine_threadsafe(cm.__aexit__(None, None, None), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def assert_clean(call):
    """Runs `call`; a refusal must be a non-INTERNAL status with a bounded message."""
    try:
        call()
    except grpc.RpcError as err:
        assert err.code() not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
                                  grpc.StatusCode.DEADLINE_EXCEEDED), (err.code(), err.details()[:300])
        assert len(err.details() or "") <= MAX_STATUS_MESSAGE, (err.code(), len(err.details()))


def assert_serves(stub):
    """A good request after the fuzzing: the base model still streams to a finish."""
    req = gateway_pb2.GenerateRequest(text="hi", sampling=common_pb2.SamplingParams(max_tokens=3))
    last = list(stub.Generate(req, timeout=TIMEOUT_S))[-1]
    assert last.finish_reason in (common_pb2.STOP, common_pb2.LENGTH)
    assert stub.GetModelInfo(gateway_pb2.GetModelInfoRequest(), timeout=TIMEOUT_S).model.ListFields()


def test_fuzz_generate(tokenizer):
    with live_gateway(tokenizer) as stub:
        @FUZZ
        @given(generate_requests())
        def check(req):
            assert_clean(lambda: list(stub.Generate(req, timeout=TIMEOUT_S)))
        check()
        assert_serves(stub)


def test_fuzz_load_unload_list_model_info(tokenizer):
    with live_gateway(tokenizer) as stub:
        @FUZZ
        @given(load_requests(), unload_requests())
        def check(load, unload):
            assert_clean(lambda: stub.LoadLora(load, timeout=TIMEOUT_S))
            assert_clean(lambda: stub.ListLoras(gateway_pb2.ListLorasRequest(), timeout=TIMEOUT_S))
            assert_clean(lambda: stub.UnloadLora(unload, timeout=TIMEOUT_S))
            assert_clean(lambda: stub.GetModelInfo(gateway_pb2.GetModelInfoRequest(), timeout=TIMEOUT_S))
        check()
        assert_serves(stub)
