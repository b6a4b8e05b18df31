from tests.cli.mesh import mesh, stop_shared_mesh

__all__ = ["mesh"]


def pytest_sessionfinish() -> None:
    stop_shared_mesh()
