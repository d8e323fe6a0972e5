"""The accelerator path of a state-level trace, run on the host.

On an accelerator a trace digests gradients, parameters, optimizer state, batch and metrics on the device and
reads them all back once per step: the copy starts when the step is recorded and is taken when the next one is
(a read that waits for the device, one per category, batch element and metric, is what made tracing a GPU job
expensive). ``CKPTVERIFY_TRACE_HOST_AS_DEVICE=1``
sends host tensors down that path, so these tests run it here, in a fresh interpreter (the switch is read at
import). tests/gpu/test_cuda.py runs the production and replay tests on a real GPU.
"""

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

    import ckptverify.trace.readback as R
    from ckptverify import TrainState
    from ckptverify.fingerprint import kernels as kern
    from ckptverify.trace import TraceHeader, TraceRecorder, first_divergence, open_trace
    from ckptverify.trace.compare import compare_runs

    root, device = Path(sys.argv[1]), sys.argv[2]
    assert R._HOST_AS_DEVICE or device != "cpu"
    kern.lanes_many([torch.zeros(3, device=device)])  # a kernel's first use checks it: reads of its own
    reads = {"tolist": 0, "item": 0}
    tolist, item = torch.Tensor.tolist, torch.Tensor.item

    def counting_tolist(self):
        reads["tolist"] += 1
        return tolist(self)

    def counting_item(self):
        reads["item"] += 1
        return item(self)

    def run(name, detail, flip_at=None, count=False):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 4)).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        state = TrainState(model=model, optimizer=opt)
        g = torch.Generator().manual_seed(1)
        per_step = []
        with TraceRecorder(root / name, header=TraceHeader(run=name, level="state", detail=detail)) as rec:
            rec.attach(model, optimizer=opt)
            for step in range(1, 6):
                x, y = torch.randn(4, 8, generator=g).to(device), torch.randn(4, 4, generator=g).to(device)
                rec.record_step_start(state)
                opt.zero_grad()
                loss = ((model(x) - y) ** 2).mean()
                loss.backward()
                # Adam reads its step counters with .item(): count the trace's reads only, around its hook
                # (which runs inside opt.step) and record_step.
                torch.Tensor.tolist = counting_tolist
                before = dict(reads)
                opt.step()
                torch.Tensor.tolist = tolist
                if step == flip_at:
                    with torch.no_grad():
                        model[0].weight.view(-1)[0:1].view(torch.int32).bitwise_xor_(1 << 20)
                torch.Tensor.tolist, torch.Tensor.item = counting_tolist, counting_item
                rec.record_step(step, metrics={"loss": loss, "lr": opt.param_groups[0]["lr"]}, batch=(x, y),
                                state=state)
                torch.Tensor.tolist, torch.Tensor.item = tolist, item
                per_step.append({k: reads[k] - before[k] for k in reads})
                if count and step == 5:
                    expected = kern.lanes_many([p.detach() for p in model.parameters()]).tolist()
        if count:
            # One read-back per step, no .item() on a metric tensor: a step's values are read when the next step
            # is recorded (its copy started a step earlier), the last step's when the recorder closes.
            assert per_step == [{"tolist": 0, "item": 0}] + [{"tolist": 1, "item": 0}] * 4, per_step
            trace = open_trace(root / name / "rank0")
            names = [f"param.{n}" for n, _ in model.named_parameters()]
            for n, (a, b) in zip(names, expected, strict=True):
                assert trace.site(n).encoding == "fp128", trace.site(n)
                assert trace.lanes(5, n) == (a % 2**64, b % 2**64), (n, trace.lanes(5, n))
            assert trace.site("grad.*").encoding == "set128" and trace.site("metric.loss").encoding == "f64"
            assert trace.site("batch.0").encoding == "fp128"
        return root / name

    replay = run("replay", "tensor", count=True)
    assert compare_runs(replay, run("same", "category")) == []
    production = run("production", "category", flip_at=3)
    d = first_divergence(replay, production)
    assert d is not None
    assert (d.step, d.site, d.via, d.tensors) == (3, "param.0.weight", "param.*", "one"), d
    print("ok")
''')


def run_script(tmp_path: Path, device: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CKPTVERIFY_TRACE_HOST_AS_DEVICE": "1" if device == "cpu" else "0"}
    return subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path), device], capture_output=True, text=True,
                          timeout=600, env=env)


def test_accelerator_path_reads_back_once_per_step_and_names_a_flipped_tensor(tmp_path: Path) -> None:
    done = run_script(tmp_path, "cpu")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")
