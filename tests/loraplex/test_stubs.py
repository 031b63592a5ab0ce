"""The generated stubs import and carry the public API's fixed names."""
from loraplex.v1 import cache_pb2_grpc, common_pb2, compute_pb2_grpc, gateway_pb2, gateway_pb2_grpc


def test_gateway_api_names():
    service = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"]
    assert {m.name for m in service.methods} >= {
        "Generate", "LoadLora", "UnloadLora", "ListLoras", "GetModelInfo"}
    assert service.methods_by_name["Generate"].server_streaming


def test_fixed_enums_and_fields():
    assert common_pb2.DType.Value("BFLOAT16") == 3
    assert common_pb2.LoadMode.Value("LOAD_MODE_NEVER") == 2
    spec = common_pb2.LoraSpec()
    assert not spec.HasField("task_id")
    spec.task_id = 0  # 0 is a valid task id, distinguishable from absent
    assert spec.HasField("task_id")
    req = gateway_pb2.GenerateRequest(text="hi", loras=[spec])
    assert req.loras[0].task_id == 0
    assert hasattr(gateway_pb2_grpc, "GatewayStub")
    assert hasattr(cache_pb2_grpc, "AdapterCacheStub")
    assert hasattr(compute_pb2_grpc, "ComputeStub")
