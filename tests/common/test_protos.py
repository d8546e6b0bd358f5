"""The committed gRPC stubs match the protos (`make proto` regenerates them)."""

from pathlib import Path

from services.common import protogen


def test_protos_committed_stubs_are_fresh(tmp_path: Path):
    written = protogen.generate(tmp_path)
    assert written, "no stubs generated"
    for fresh in written:
        rel = fresh.relative_to(tmp_path)
        committed = protogen.OUT_DIR / rel
        assert committed.exists(), f"{rel} is missing: run `make proto` and commit the stubs"
        assert committed.read_text() == fresh.read_text(), (
            f"{rel} is stale: run `make proto` and commit the stubs"
        )


def test_protos_every_rpc_and_field_is_commented():
    for proto in sorted(protogen.PROTO_ROOT.glob("conveyor/v1/*.proto")):
        lines = proto.read_text().splitlines()
        for i, line in enumerate(lines):
            stripped = line.strip()
            is_decl = stripped.startswith("rpc ") or (
                "=" in stripped
                and stripped.endswith(";")
                and not stripped.startswith(("syntax", "package", "option", "import", "//"))
            )
            if not is_decl:
                continue
            # A field may share the comment of the field just above it (a pair like start/end).
            j = i - 1
            while j >= 0 and "=" in lines[j] and lines[j].strip().endswith(";"):
                j -= 1
            assert lines[j].strip().startswith("//"), (
                f"{proto.name}:{i + 1} has no comment: {stripped}"
            )
