"""The committed generated code matches the .proto files and imports as expbuf.proto."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_regeneration_changes_nothing(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("expbuf_proto_generate", ROOT / "proto" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    written = module.generate(tmp_path)
    assert {p.name for p in written} == {"buffer_pb2.py", "buffer_pb2.pyi", "buffer_pb2_grpc.py"}
    for fresh in written:
        committed = ROOT / "proto" / "expbuf" / "v1" / fresh.name
        assert committed.read_text() == fresh.read_text(), f"{fresh.name} is stale: run python proto/generate.py"


def test_service_has_every_rpc_of_the_design() -> None:
    from expbuf.proto.v1 import buffer_pb2, buffer_pb2_grpc

    service = buffer_pb2.DESCRIPTOR.services_by_name["ExperienceBuffer"]
    assert service.full_name == "expbuf.v1.ExperienceBuffer"
    assert set(service.methods_by_name) == {
        "Push", "PushStream", "Sample", "Ack", "Nack", "Renew", "Get", "Delete", "Seal",
        "Stats", "ServerInfo", "CreateTable", "ListTables", "DropTable", "SetTrainerVersion",
        "Admit", "FinishGrant", "ListExperiences", "ResetOffPolicy", "Writers",
        "CreateDataset", "ListDatasets", "Claim", "RenewClaims", "ReleaseClaims", "ReportPrompts", "ListPrompts",
        "Retire", "ReadFields",
        "PutValues", "GetValues", "ClearValues", "FailRuns", "GetPartials", "ReadPartials",
    }  # fmt: skip
    assert service.methods_by_name["PushStream"].client_streaming
    assert service.methods_by_name["Sample"].server_streaming
    read_fields = service.methods_by_name["ReadFields"]
    assert read_fields.server_streaming and not read_fields.client_streaming
    assert hasattr(buffer_pb2_grpc, "ExperienceBufferServicer")
