"""The shared bucket machinery, in one process: equality with a plain torch step, accumulation,
parameters without gradients, bucket layout and misuse."""

import pytest
import torch
from torch import nn

import commlab
from commlab.base.errors import ConfigError, ModelMismatch
from commlab.core.exchanger import make_buckets
from commlab.core.manifest import manifest_difference, model_manifest
from commlab.transport.rendezvous import RankInfo


def model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))


def data(seed=1, n=16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def plain_steps(m, spec, batches):
    opt = spec.build(m.parameters())
    for x, y in batches:
        opt.zero_grad()
        nn.functional.cross_entropy(m(x), y).backward()
        opt.step()
    return m


@pytest.mark.parametrize("spec", [commlab.OptimizerSpec("sgd", lr=0.1, momentum=0.9, weight_decay=1e-3),
                                  commlab.OptimizerSpec("adam", lr=0.01)])
@pytest.mark.parametrize("bucket_mb", [1e-4, 25])  # one parameter per bucket, and everything in one
def test_local_equals_plain_torch_steps(spec, bucket_mb):
    batches = [data(s) for s in range(5)]
    ref = plain_steps(model(), spec, batches)
    m = model()
    ex = commlab.connect(f"local://?bucket_mb={bucket_mb}", RankInfo.single())
    ex.setup(m, spec)
    for x, y in batches:
        ex.zero_grad()
        nn.functional.cross_entropy(m(x), y).backward()
        ex.step()
    for a, b in zip(m.parameters(), ref.parameters()):
        assert torch.equal(a, b)
    assert ex.stats.steps == 5


def test_accumulation_with_no_sync_equals_the_big_batch():
    spec = commlab.OptimizerSpec("sgd", lr=0.1)
    x, y = data(n=32)
    m_ref = model()
    opt = spec.build(m_ref.parameters())
    (nn.functional.cross_entropy(m_ref(x), y, reduction="sum") / 32).backward()
    opt.step()
    m = model()
    ex = commlab.connect("local://", RankInfo.single())
    ex.setup(m, spec)
    ex.zero_grad()
    with ex.no_sync():
        for i in range(3):
            (nn.functional.cross_entropy(m(x[i * 8:(i + 1) * 8]), y[i * 8:(i + 1) * 8], reduction="sum") / 32).backward()
    (nn.functional.cross_entropy(m(x[24:]), y[24:], reduction="sum") / 32).backward()
    ex.step()
    for a, b in zip(m.parameters(), m_ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.used, self.unused = nn.Linear(4, 4), nn.Linear(4, 2), nn.Linear(4, 2)

    def forward(self, x):
        return self.used(self.body(x))


def test_parameter_without_gradient_is_not_updated():
    m = TwoHeads()
    before = m.unused.weight.detach().clone()
    ex = commlab.connect("local://", RankInfo.single())
    ex.setup(m, commlab.OptimizerSpec("sgd", lr=0.5, momentum=0.9, weight_decay=0.1))
    for _ in range(3):
        ex.zero_grad()
        m(torch.ones(2, 4)).sum().backward()
        ex.step()
    assert torch.equal(m.unused.weight, before)  # weight decay would have moved it, had it been stepped
    assert not torch.equal(m.used.weight, TwoHeads().used.weight)


def test_grads_are_views_into_buckets_and_stay_so():
    m = model()
    ex = commlab.connect("local://", RankInfo.single())
    ex.setup(m, commlab.OptimizerSpec())
    ptrs = {b.buffer.data_ptr() for b in ex.buckets}
    for _ in range(2):
        ex.zero_grad()
        m(data()[0]).sum().backward()
        ex.step()
    for b in ex.buckets:
        for i, p in enumerate(b.params):
            assert p.grad.data_ptr() == b.view(i).data_ptr()
    assert {b.buffer.data_ptr() for b in ex.buckets} == ptrs


def test_caller_replaced_grads_are_copied_in():
    m = model()
    ex = commlab.connect("local://", RankInfo.single())
    ex.setup(m, commlab.OptimizerSpec("sgd", lr=1.0))
    for p in m.parameters():
        p.grad = None  # like optimizer.zero_grad(set_to_none=True)
    before = [p.detach().clone() for p in m.parameters()]
    m(data()[0]).sum().backward()
    grads = [p.grad.clone() for p in m.parameters()]
    ex.step()
    for p, b, g in zip(m.parameters(), before, grads):
        torch.testing.assert_close(p, b - g)


def test_buckets_reverse_order_and_size_cap():
    m = nn.Sequential(nn.Linear(100, 100), nn.Linear(100, 100), nn.Linear(100, 10))
    named = list(m.named_parameters())
    buckets = make_buckets(named, bucket_bytes=100 * 100 * 4, carry_presence=True)
    order = [n for b in buckets for n in b.names]
    assert order == [n for n, _ in reversed(named)]
    assert [b.names for b in buckets] == [["2.bias", "2.weight", "1.bias", "1.weight"], ["0.bias", "0.weight"]]
    assert buckets[0].buffer.numel() == buckets[0].numel + 4  # presence flags


def test_backward_twice_without_no_sync_accumulates_as_plain_torch():
    """A second backward before the step (no no_sync, no zero_grad) adds to the exchanged gradient and
    is exchanged again, as under DDP; with one worker that is plain torch's accumulation."""
    m, ref = model(), model()
    ref.load_state_dict(m.state_dict())
    ex = commlab.connect("local://", RankInfo.single())
    ex.setup(m, torch.optim.SGD(m.parameters(), lr=0.1))
    x, _ = data()
    m(x).sum().backward()
    m(x * 2).pow(2).sum().backward()
    ref(x).sum().backward()
    ref(x * 2).pow(2).sum().backward()
    for p, q in zip(m.parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-6, atol=1e-7)
    assert ex.stats.exchanges == 2


def test_misuse_is_named():
    ex = commlab.connect("local://", RankInfo.single())
    with pytest.raises(ConfigError, match=r"call setup\(model, optimizer\) before step\(\)"):
        ex.step()
    with pytest.raises(ModelMismatch, match="no trainable parameters"):
        ex.setup(nn.ReLU(), commlab.OptimizerSpec())


def test_ps_refuses_a_model_neither_on_the_cpu_nor_on_cuda_before_contacting_servers():
    """ps:// serves CPU and CUDA workers (CUDA buckets through pinned host mirrors); a model on another
    device (meta here) is refused, naming the parameter and device, before any socket opens (nothing
    listens on the port given)."""
    ex = commlab.connect("ps://127.0.0.1:9?timeout=5", RankInfo.single())
    model = nn.Sequential(nn.Linear(3, 2)).to("meta")
    with pytest.raises(ConfigError, match=r"ps:// serves workers whose parameters are on the CPU or a CUDA GPU, "
                                          r"and 0.weight is on meta"):
        ex.setup(model, commlab.OptimizerSpec())


def test_manifest_difference_names_the_parameter():
    a = model_manifest(nn.Linear(3, 2))
    b = model_manifest(nn.Linear(4, 2))
    assert manifest_difference(a, b, "rank 0") == "parameter 'weight' is float32[2, 3] here but float32[2, 4] on rank 0"
    assert manifest_difference(a, a, "rank 0") is None


def test_torch_errors_map_onto_the_hierarchy_by_one_rule():
    """handles.WorkHandle (collectives) and the ring's torch links classify what torch raised the same way:
    by type where torch gives one, by gloo's words where it does not; only the fallback differs."""
    import torch.distributed as dist

    from commlab.base.errors import CommError, CommTimeout, PeerLost, from_torch

    assert from_torch(RuntimeError("[../gloo/pair.cc:534] Timed out waiting 5000ms for recv\nmore")) == (
        CommTimeout, "[../gloo/pair.cc:534] Timed out waiting 5000ms for recv")
    assert from_torch(TimeoutError())[0] is CommTimeout
    assert from_torch(RuntimeError("Connection closed by peer [127.0.0.1]:41234"))[0] is PeerLost
    assert from_torch(dist.DistNetworkError("socket"))[0] is PeerLost
    assert from_torch(RuntimeError("unsupported dtype"))[0] is CommError
    assert from_torch(RuntimeError("unsupported dtype"), otherwise=PeerLost)[0] is PeerLost
