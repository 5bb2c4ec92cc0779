"""scale_batch_size in a real two-process DDP job of Lightning (gloo, CPU, launched as torchrun
launches it; issue 36, part 2): the ranks have different memory, the search ends on both with
the same size, the largest that fits on the smaller rank (found by trying every size in one
process), and both modules are set to it; the fit that follows runs at it.

GPU memory is the one thing stood in for, as in test_batch_size_torchrun_trainer.py: the
training step takes 2 MiB per sample of the batch from vramkit's cpu pool for the length of its
forward pass, and each rank's pool is capped (rank 0 at 48 MiB, rank 1 at 96 MiB)."""

from __future__ import annotations

import textwrap

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("lightning.pytorch")

from torchrun_jobs import launch  # noqa: E402

LIMITS_MIB = (48, 96)

WORKER = textwrap.dedent(r"""
    import json, os, sys, tempfile, warnings, logging
    import torch
    import lightning.pytorch as L
    import vramkit
    from vramkit.integrations.lightning import scale_batch_size

    mode, limit_mib = sys.argv[1], int(sys.argv[2])
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    vramkit.set_memory_limit(limit_mib << 20, "cpu")

    def take_and_give(n):  # the stand-in for activation memory: 2 MiB a sample
        vramkit.raw_free(vramkit.raw_alloc(n << 21, "cpu"))

    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.layer = torch.nn.Linear(8, 1)
            self.batch_size = 2
            self.sizes = []
            self.data = torch.randn(1024, 8, generator=torch.Generator().manual_seed(0))
        def training_step(self, batch, index):
            self.sizes.append(batch.shape[0])
            take_and_give(batch.shape[0])
            return self.layer(batch).pow(2).mean()
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)
        def train_dataloader(self):
            return torch.utils.data.DataLoader(self.data, batch_size=self.batch_size)

    if mode == "reference":  # every size in turn, one process, no search
        best = 0
        for bs in range(1, 257):
            try:
                take_and_give(bs)
            except vramkit.OutOfMemoryError:
                break
            finally:
                vramkit.empty_cache("cpu")
            best = bs
        print("RESULT " + json.dumps({"batch_size": best}), flush=True)
        sys.exit(0)

    net = Net()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    trainer = L.Trainer(accelerator="cpu", strategy="ddp", devices=2, max_steps=2, logger=False,
                        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
                        default_root_dir=tempfile.mkdtemp())
    result = scale_batch_size(trainer, net, max_batch_size=256)
    same = all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    net.sizes.clear()
    trainer.fit(net)
    print("RESULT " + json.dumps({"batch_size": result.batch_size, "set": net.batch_size, "fit_sizes": net.sizes,
                                  "weights_unchanged": same, "rank": trainer.global_rank,
                                  "world": trainer.world_size,
                                  "limit_after": vramkit.get_settings("cpu")["memory_limit"],
                                  "outcomes": [[a.batch_size, a.outcome, a.local_outcome] for a in result.attempts]}),
          flush=True)
    # Lightning leaves its process group up after fit; torch asks for it to be destroyed before
    # exit, and gloo's threads can abort the interpreter's exit otherwise ("terminate called
    # without an active exception", seen once in CI)
    import torch.distributed as dist
    dist.destroy_process_group()
""")


def test_ddp_ranks_with_different_memory_set_the_same_size(tmp_path):
    want = launch(tmp_path / "ref", WORKER, "reference", [min(LIMITS_MIB)], deadline=120)[0]["batch_size"]
    assert 0 < want < 256
    ranks = launch(tmp_path, WORKER, "ddp", LIMITS_MIB, deadline=300)
    assert sorted(r["rank"] for r in ranks) == [0, 1] and [r["world"] for r in ranks] == [2, 2]
    assert [r["batch_size"] for r in ranks] == [want, want]
    assert [r["set"] for r in ranks] == [want, want]
    assert all(r["weights_unchanged"] for r in ranks)
    assert all(set(r["fit_sizes"]) == {want} for r in ranks)  # the fit after the search runs at it
    assert ranks[0]["outcomes"] == [[b, o, ranks[0]["outcomes"][i][2]] for i, (b, o, _) in enumerate(ranks[1]["outcomes"])]
    assert any(local == "oom" for _, _, local in ranks[1]["outcomes"])  # the larger rank ran out with the smaller
    assert [r["limit_after"] for r in ranks] == [m << 20 for m in LIMITS_MIB]
