"""CudaGraphRunner: padding and backend checks on any machine; on a GPU, graph replay equals eager decode."""

import pytest
import torch
from torch import nn

from radixlm_kernels.base import AttentionLayer
from radixlm_kernels.torch_native import TorchNativeBackend
from radixlm_kernels.triton_backend import TritonBackend
from runtime.model_executor.cuda_graph_runner import CudaGraphRunner, padded_batch_size, supports_cuda_graph
from runtime.model_executor.forward_batch import ForwardBatch

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA)")


def test_padded_batch_size_picks_next_captured():
    sizes = [1, 2, 4, 8, 16]
    assert [padded_batch_size(b, sizes) for b in (1, 2, 3, 5, 8, 9, 16)] == [1, 2, 4, 8, 8, 16, 16]
    assert padded_batch_size(17, sizes) is None


def test_graph_hooks_per_backend():
    assert supports_cuda_graph(TritonBackend)
    assert not supports_cuda_graph(TorchNativeBackend)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_refuses_without_cuda():
    with pytest.raises(RuntimeError, match="CUDA"):
        CudaGraphRunner(lambda batch: batch.input_ids, [1, 2], attn_backend=object(), device="cpu")


class ToyDecoder(nn.Module):
    """Embeddings -> attention layers through the backend -> logits: enough to exercise KV writes, positions
    and every layer's attention inside a graph."""

    def __init__(
        self,
        backend,
        num_layers: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        vocab: int = 64,
        hidden: int = 96,
        max_pos: int = 4096,
    ):
        super().__init__()
        self.backend = backend
        self.shape = (num_heads, num_kv_heads, head_dim)
        self.embed = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(max_pos, hidden)
        self.qkv = nn.ModuleList(
            nn.Linear(hidden, (num_heads + 2 * num_kv_heads) * head_dim) for _ in range(num_layers)
        )
        self.proj = nn.ModuleList(nn.Linear(num_heads * head_dim, hidden) for _ in range(num_layers))
        self.head = nn.Linear(hidden, vocab)
        self.layers = [
            AttentionLayer(i, num_heads, num_kv_heads, head_dim, head_dim**-0.5) for i in range(num_layers)
        ]

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        h, hkv, d = self.shape
        x = self.embed(batch.input_ids) + self.pos(batch.positions)
        for qkv, proj, layer in zip(self.qkv, self.proj, self.layers, strict=True):
            q, k, v = qkv(x).split([h * d, hkv * d, hkv * d], dim=-1)
            o = self.backend.forward(q.view(-1, h, d), k.view(-1, hkv, d), v.view(-1, hkv, d), layer, batch)
            x = x + proj(o.reshape(-1, h * d))
        return self.head(x).float()


def _sub_batch(batch: ForwardBatch, idx: list[int]) -> ForwardBatch:
    seq_lens = [batch.seq_lens_cpu[i] for i in idx]
    rows = batch.req_pool_indices[idx].tolist()
    return ForwardBatch.build_decode(
        batch.input_ids[idx].tolist(), seq_lens, rows, batch.out_cache_loc[idx], device="cuda"
    )


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("backend_name", ["triton", "flashinfer"])
def test_replay_matches_eager(backend_name, make_case):
    num_layers, hkv, group, dim = 2, 2, 3, 64
    case = make_case(
        [5, 40, 1, 300, 17, 64, 2, 130],
        None,
        num_kv_heads=hkv,
        group=group,
        head_dim=dim,
        dtype=torch.float16,
        device="cuda",
        layer_id=num_layers - 1,
        seed=3,
    )
    if backend_name == "flashinfer":
        pytest.importorskip("flashinfer")
        from radixlm_kernels.flashinfer_backend import FlashInferBackend

        backend = FlashInferBackend(case.kv_pool, case.req_pool)
    else:
        backend = TritonBackend(case.kv_pool, case.req_pool)
    torch.manual_seed(0)
    model = ToyDecoder(backend, num_layers, hkv * group, hkv, dim).to("cuda", torch.float16).eval()
    case.batch.input_ids.random_(0, 64)
    with torch.inference_mode():
        runner = CudaGraphRunner(model, [1, 2, 4, 8], attn_backend=backend)
        # sizes 3 (padded to 4), 8, 1, then 3 again after a larger batch left live rows in the buffers
        for idx in ([0, 3, 5], list(range(8)), [6], [7, 1, 2]):
            batch = _sub_batch(case.batch, idx)
            assert runner.can_run(batch)
            backend.init_forward_metadata(batch)
            eager = model(batch)
            graph = runner.replay(batch)
            assert graph.shape == eager.shape == (len(idx), 64)
            torch.testing.assert_close(graph, eager, atol=2e-2, rtol=2e-2)
        extend = ForwardBatch.build_extend([[1, 2]], [0], [0], torch.tensor([1, 2]), device="cuda")
        assert not runner.can_run(extend)
