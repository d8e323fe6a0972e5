"""The one allowlist unpickler framework (``ckptverify.safeparse.unpickler``) and its configurations.

Each configuration (DCP ``.metadata``; ``torch.save``'s ``data.pkl``, refusing unknown globals in a tensor item,
recording them in a whole file) is an allowlist, what its globals resolve to and a budget; every refusal is a
``BadPickle`` (a tensor item's turned into ``pickle.UnpicklingError``). These tests hold every configuration to the
framework's shared promises: nothing outside the allowlist is imported or called, a shared stand-in cannot be
modified, a memo index far past the entries made is refused before anything is allocated, hashed tuples are
bounded, and the work budget refuses with the configuration's own message.
"""

from __future__ import annotations

import ast
import io
import pathlib
import pickle
import zipfile

import pytest
import torch

import ckptverify.safeparse
from ckptverify.dcp import metadata_pickle as sp
from ckptverify.errors import BadPickle, UnsafeGlobal
from ckptverify.safeparse import unpickler as up
from ckptverify.safeparse.torchsave import item_header, scan_pickle

MD = b"torch.distributed.checkpoint.metadata"


def _global(module: bytes, name: bytes) -> bytes:
    return b"\x8c" + bytes([len(module)]) + module + b"\x8c" + bytes([len(name)]) + name + b"\x93"


def _tensor_data_pkl(t: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(t, buf)
    z = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    return z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))


class _Calls:
    """A global whose call would be noticed (``os.system`` stands for any of them)."""

    def __reduce__(self):
        return (print, ("called",))


def test_a_global_outside_each_allowlist_is_never_called(capsys):
    data = pickle.dumps(_Calls(), protocol=4)
    with pytest.raises(UnsafeGlobal):
        sp.parse(data)
    with pytest.raises(UnsafeGlobal):
        sp.parse_reference(data)
    with pytest.raises(pickle.UnpicklingError, match=r"builtins\.print is not part of a tensor record"):
        item_header(data)
    scan = scan_pickle(data)  # the scan keeps it as an inert placeholder and reports its name
    assert scan.opaque == {"builtins.print"}
    assert type(scan.root).__name__ == "Opaque" and scan.root.args == ("called",)
    assert "called" not in capsys.readouterr().out


@pytest.mark.parametrize("read, refused", [
    (sp.parse_reference, BadPickle),
    (sp.parse, BadPickle),
    (item_header, pickle.UnpicklingError),
])
def test_a_shared_stand_in_cannot_be_modified(read, refused):
    # BUILD onto the dtype global with a state that would rename it: refused by the stand-in itself.
    data = b"\x80\x04" + _global(b"torch", b"float32") + b"}\x8c\x06_label\x8c\x05int64sb."
    with pytest.raises(refused):
        read(data)
    clean = _tensor_data_pkl(torch.ones(3))
    assert item_header(clean).dtype == "float32"


@pytest.mark.parametrize("read", [sp.parse_reference, sp.parse, scan_pickle])
def test_a_stand_in_cannot_be_called(read):
    with pytest.raises(BadPickle, match=r"torch\.float32 is not callable"):
        read(b"\x80\x04" + _global(b"torch", b"float32") + b")R.")  # torch.float32()


@pytest.mark.parametrize("read, refused", [
    (sp.parse_reference, BadPickle),
    (item_header, pickle.UnpicklingError),
    (scan_pickle, BadPickle),
])
def test_a_memo_index_far_past_the_entries_made_is_refused_at_once(read, refused):
    # LONG_BINPUT of index 2**30 after no entry: the C unpickler would zero-fill gigabytes of memo slots.
    data = b"\x80\x02N" + b"r" + (2**30).to_bytes(4, "little") + b"."
    with pytest.raises(refused, match="memo"):
        read(data)


def test_each_configuration_refuses_a_tuple_key_by_its_own_bound():
    deep = b"\x80\x02}" + b"N" + b"\x85" * 100 + b"Ns."  # {((((None,),),)...): None}, 100 deep
    with pytest.raises(BadPickle, match="nests deeper than 64"):
        sp.parse_reference(deep)
    with pytest.raises(pickle.UnpicklingError, match=r"data\.pkl uses a tuple as a dict key"):
        item_header(deep)
    shallow = b"\x80\x02}" + b"N" + b"\x85" * 3 + b"Ns."
    assert scan_pickle(shallow).root == {(((None,),),): None}  # within the scan's nesting bound
    too_deep = b"\x80\x02}" + b"N" + b"\x85" * 300 + b"Ns."
    with pytest.raises(BadPickle, match="nests deeper than 200"):
        scan_pickle(too_deep)


def test_the_budget_refuses_with_its_configurations_message():
    budget = up.Budget(3, "spent")
    budget.charge(3)
    with pytest.raises(BadPickle, match="spent"):
        budget.charge()
    budget = sp._budget(0)
    with pytest.raises(BadPickle, match="asks for more"):
        budget.charge(budget.left + 1)
    # The scan's object budget: a list of a thousand globals is more than a budget of 100 objects allows.
    data = b"\x80\x02(" + b"ctorch\nSize\n" * 1000 + b"l."
    with pytest.raises(BadPickle, match="builds more than"):
        scan_pickle(data, max_objects=100)
    assert len(scan_pickle(data).root) == 1000


def test_safeparse_imports_nothing_above_it():
    """The readers are the lowest layer: they import no other part of the package but the errors and findings."""
    folder = pathlib.Path(ckptverify.safeparse.__file__).parent
    allowed = ("ckptverify.safeparse", "ckptverify.errors", "ckptverify.findings", "ckptverify._version")
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ckptverify"):
                assert node.module.startswith(allowed), f"{path.name} imports {node.module}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    assert not alias.name.startswith("ckptverify") or alias.name.startswith(allowed), path.name


_STORAGE = b"(X\x07\x00\x00\x00storagectorch\nFloatStorage\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpuK\x06tQ"
_TENSOR = b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\n(" + _STORAGE + b"K\x00(K\x06t(K\x01ttR"


@pytest.mark.parametrize("read, refused", [(item_header, pickle.UnpicklingError), (scan_pickle, BadPickle)])
def test_a_checked_tensor_record_cannot_be_rewritten_by_build(read, refused):
    # BUILD onto the record _rebuild_tensor_v2 returned, with a dict state (a shape past the storage) or a
    # slot-tuple state (a shape of 2**127): both would replace fields after they were checked.
    for state in (b"}X\x05\x00\x00\x00shape(K\x07ts", b"(NK\x00(\x8a\x10" + b"\xff" * 15 + b"\x7ft(K\x01tNt"):
        with pytest.raises(refused, match="modifies a TensorHeader"):
            read(_TENSOR + state + b"b.")
    assert read(_TENSOR + b".") is not None


def test_a_tuple_key_of_shared_references_is_refused_before_it_is_hashed():
    # Each level holds the previous one twice: 60 memo entries, 2**60 values for hash() to visit.
    data = bytearray(b"\x80\x02K\x01\x94")
    for i in range(60):
        data += b"h" + bytes([i]) + b"h" + bytes([i]) + b"\x86\x94"
    data += b"}h" + bytes([60]) + b"K\x00s."
    with pytest.raises(BadPickle, match="holds more than 1024 values"):
        scan_pickle(bytes(data))
    with pytest.raises(pickle.UnpicklingError, match="uses a tuple as a dict key"):
        item_header(bytes(data))
