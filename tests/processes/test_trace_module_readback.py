"""Level ``module`` on the accelerator path, run on the host (``CKPTVERIFY_TRACE_HOST_AS_DEVICE=1``, read at import:
a fresh interpreter): a model of many modules reads back once per step, however many hook calls the step makes,
and records what a read per hook call recorded; a loss scaler's state is read with the row too, not by its
``state_dict()``'s ``.item()`` calls."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent('''
    import sys
    from pathlib import Path

    import torch
    from torch import nn

    import ckptverify.trace.category as C
    import ckptverify.trace.hostread as H
    import ckptverify.trace.readback as R
    from ckptverify import TrainState
    from ckptverify.fingerprint import kernels as kern
    from ckptverify.trace import TraceHeader, TraceRecorder, open_trace
    from ckptverify.trace.cells import _object_cell, _value_lanes
    from ckptverify.trace.sites import module_site

    assert R._HOST_AS_DEVICE
    root = Path(sys.argv[1])
    kern.lanes_many([torch.zeros(3)])  # a kernel's first use checks it: reads of its own

    class Pair(nn.Module):  # a module whose output is a tuple: digested as a composite value
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            return self.a(x), torch.relu(self.b(x))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.pairs = nn.ModuleList(Pair() for _ in range(12))
            self.head = nn.Linear(8, 2)

        def forward(self, x):
            for p in self.pairs:
                a, b = p(x)
                x = a + b
            return self.head(x)

    def device_digests(tensors):  # what a read per tensor gave on an accelerator
        return [(a % 2**64) << 64 | (b % 2**64) for a, b in kern.lanes_many(tensors).tolist()]

    def run(name, count):
        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu")
        scaler.scale(torch.ones(()))  # makes its scale and growth tracker: tensors on the "device"
        state = TrainState(model=model, optimizer=opt, scaler=scaler)
        g = torch.Generator().manual_seed(1)
        expected = {}
        if not count:
            # What a read per hook call made of the same values on a device: _object_cell, with every tensor
            # digest read at once (as on CUDA).
            def remember(module_name):
                def hook(module, args, output):
                    saved, C.tensor_digests = C.tensor_digests, device_digests
                    try:
                        for site, kind, obj in ((module_site(module_name, "fwd", 0), "module_out", output),
                                                (module_site(module_name, "in", 0), "module_in", args)):
                            expected.setdefault(site, _object_cell(site, kind, obj, type(module).__name__).lanes)
                    finally:
                        C.tensor_digests = saved
                return hook

            for n in ("pairs.3", "pairs.3.a", "head"):
                model.get_submodule(n).register_forward_hook(remember(n))
        counts = {"to_host": 0, "tolist": 0, "item": 0}
        per_step = []
        to_host, tolist, item = H.to_host, torch.Tensor.tolist, torch.Tensor.item

        def c_to_host(t):
            counts["to_host"] += 1
            return to_host(t)

        def c_tolist(self):
            counts["tolist"] += 1
            return tolist(self)

        def c_item(self):
            counts["item"] += 1
            return item(self)

        with TraceRecorder(root / name, header=TraceHeader(run=name, level="module")) as rec:
            rec.attach(model, optimizer=opt)
            for step in range(1, 5):
                x, y = torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)
                if count:
                    H.to_host, torch.Tensor.tolist, torch.Tensor.item = c_to_host, c_tolist, c_item
                before = dict(counts)
                rec.record_step_start(state)
                opt.zero_grad()
                loss = ((model(x) - y) ** 2).mean()
                loss.backward()
                opt.step()
                scaler.update(2.0 ** (step + 3))  # a new scale each step (set in place: no read)
                rec.record_step(step, metrics={"loss": loss}, batch=(x, y), state=state)
                H.to_host, torch.Tensor.tolist, torch.Tensor.item = to_host, tolist, item
                per_step.append({k: counts[k] - before[k] for k in counts})
                expected[("scaler", step)] = _value_lanes(scaler.state_dict())
        return per_step, expected

    per_step, scaled = run("counted", True)
    # One read a whole step (the row before's, started a step earlier; none in the first step), every device
    # value of the step read through it: 12 * 3 + 2 modules, each with an input, an output and an
    # input-gradient site, are not 114 reads.
    one = {"to_host": 1, "tolist": 1, "item": 0}
    assert per_step == [{"to_host": 0, "tolist": 0, "item": 0}] + [one] * 3, per_step
    trace = open_trace(root / "counted" / "rank0")
    assert sum(1 for s in trace.sites if s.category == "module") >= 3 * (12 * 3 + 2)
    assert len({lanes for lanes in scaled.values()}) == 4
    for (site, step), lanes in scaled.items():
        assert trace.lanes(step, site) == tuple(x % 2**64 for x in lanes), (site, step)
    _, expected = run("expected", False)
    expected = {k: v for k, v in expected.items() if isinstance(k, str)}
    assert len(expected) == 6
    for site, lanes in expected.items():
        assert trace.lanes(1, site) == tuple(x % 2**64 for x in lanes), (site, trace.lanes(1, site), lanes)

    # A learning rate held as a tensor on the device (a capturable optimizer's): read with the row, not by
    # float(); the cells are those float() made.
    import ckptverify.trace.hyperparams as HP
    from ckptverify.trace.readback import _Deferred, _ReadBack
    from ckptverify.trace.store import decode

    opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=torch.tensor(0.1), momentum=0.9)
    made = HP._HparamCells("hparam.", "tensor")
    made([opt])  # finds the entries once (one read)
    opt.param_groups[0]["lr"].fill_(0.25)
    reads = []
    tolist, item = torch.Tensor.tolist, torch.Tensor.item
    torch.Tensor.tolist = lambda self: reads.append("tolist") or tolist(self)
    torch.Tensor.item = lambda self: reads.append("item") or item(self)
    try:
        got = made([opt])
    finally:
        torch.Tensor.tolist, torch.Tensor.item = tolist, item
    assert reads == [] and [type(x) for x in got] == [_Deferred], (reads, got)
    on_device, HP._on_device = HP._on_device, lambda values: []
    try:
        want = HP._HparamCells("hparam.", "tensor")([opt])
    finally:
        HP._on_device = on_device
    assert _ReadBack(got).cells() == want, (_ReadBack(got).cells(), want)
    lr = next(c for c in want if c.site == "hparam.0.lr")
    assert decode(lr.lanes, lr.encoding) == 0.25
    print("ok")
''')


def test_module_level_reads_back_once_per_step_and_records_what_a_read_per_hook_did(tmp_path: Path) -> None:
    env = {**os.environ, "CKPTVERIFY_TRACE_HOST_AS_DEVICE": "1"}
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True,
                          timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")
