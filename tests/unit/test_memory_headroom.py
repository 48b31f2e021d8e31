"""How much memory Loom counts on before it lays weights out anew (models/pages.py): the system's
MemAvailable, or a container's limit less what its group uses where that is less."""

import pytest

from models import pages


def fake_group(tmp_path, monkeypatch, version, limit, usage):
    root, limit_file, usage_file = pages.GROUP_MEMORY[version]
    base = tmp_path / version
    group = base / "app"
    group.mkdir(parents=True)
    (group / limit_file).write_text(f"{limit}\n")
    (group / usage_file).write_text(f"{usage}\n")
    monkeypatch.setitem(pages.GROUP_MEMORY, version, (str(base), limit_file, usage_file))
    line = "0::/app" if version == "v2" else "4:memory:/app"
    (tmp_path / "cgroup").write_text(f"9:name=systemd:/\n{line}\n")
    monkeypatch.setattr(pages, "PROC_GROUPS", str(tmp_path / "cgroup"))


@pytest.mark.parametrize("version", ["v2", "v1"])
def test_a_containers_limit_bounds_the_memory_counted_on(tmp_path, monkeypatch, version):
    fake_group(tmp_path, monkeypatch, version, limit=3 * 2**30, usage=2**30)
    assert pages._group_headroom() == 2 * 2**30
    system = pages.available_memory()
    assert system is not None and system <= 2 * 2**30


@pytest.mark.parametrize("version, limit", [("v2", "max"), ("v1", 9223372036854771712)])
def test_no_limit_leaves_the_systems_figure(tmp_path, monkeypatch, version, limit):
    fake_group(tmp_path, monkeypatch, version, limit=limit, usage=2**30)
    assert pages._group_headroom() is None
    with open("/proc/meminfo") as info:
        assert any(line.startswith("MemAvailable:") for line in info)
    assert pages.available_memory() > 0
