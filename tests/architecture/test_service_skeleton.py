"""Every service folder has the same skeleton, so knowing one means knowing all:
``server.py`` (the gRPC glue), ``client.py`` (its one typed client), ``convert.py`` (protos
<-> typed values), ``types.py`` (those values), and logic modules that import no grpc."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SERVICES = Path(__file__).resolve().parents[2] / "services"
SKELETON = ("server.py", "client.py", "convert.py", "types.py")
NAMES = sorted(p.name for p in SERVICES.iterdir() if (p / "__init__.py").exists())


def test_the_services_are_the_five_roles():
    assert NAMES == ["coordinator", "env", "reward", "rollout", "trainer"]


@pytest.mark.parametrize("service", NAMES)
def test_a_service_has_the_skeleton(service):
    missing = [name for name in SKELETON if not (SERVICES / service / name).is_file()]
    assert not missing, f"services/{service}/ lacks {missing}"


def _imports_grpc(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module]
        if any(n == "grpc" or n.startswith(("grpc.", "grpc_")) for n in names):
            return True
    return False


@pytest.mark.parametrize("service", NAMES)
def test_only_the_server_and_the_client_import_grpc(service):
    glue = {"server.py", "client.py"}
    offenders = [
        str(p.relative_to(SERVICES))
        for p in sorted((SERVICES / service).rglob("*.py"))
        if p.name not in glue and _imports_grpc(p)
    ]
    assert not offenders, f"logic modules importing grpc: {offenders}"
