"""`utils.files.write_atomically`: a file is whole under its name or absent, with a new file's usual permissions."""

from __future__ import annotations

import os
import stat

import pytest

from optimum_flatten.utils.files import TEMPORARY_PREFIX, write_atomically, write_bytes_atomically


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "state.json"
    write_bytes_atomically(target, b"old")

    def broken(temporary):
        temporary.write_bytes(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomically(target, broken)
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_the_file_gets_the_permissions_of_a_plain_new_file(tmp_path):
    plain = tmp_path / "plain"
    plain.write_bytes(b"x")
    write_bytes_atomically(tmp_path / "sub" / "atomic", b"x")  # the folder is created too
    mode = stat.S_IMODE(os.stat(tmp_path / "sub" / "atomic").st_mode)
    assert mode == stat.S_IMODE(os.stat(plain).st_mode)
    assert not any(p.name.startswith(TEMPORARY_PREFIX) for p in (tmp_path / "sub").iterdir())


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_a_writer_that_makes_its_file_private_gets_the_plain_mode_back(tmp_path, umask):
    """safetensors writes 0600 whatever the umask: the teacher-text cache's rows were unreadable beside its 0644
    keys."""
    import torch
    from safetensors.torch import save_file

    old = os.umask(umask)
    try:
        plain = tmp_path / "plain"
        plain.write_bytes(b"x")
        rows = tmp_path / "rows.safetensors"
        write_atomically(rows, lambda path: save_file({"input_ids": torch.zeros(2, 3, dtype=torch.long)}, str(path)))
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(rows).st_mode) == stat.S_IMODE(os.stat(plain).st_mode) == 0o666 & ~umask
