"""find_trainer_batch_size in a real two-process DDP job of Hugging Face's Trainer (gloo, CPU;
issue 36, part 2): the ranks have different memory, the search ends on both with the same size,
which is the largest that fits on the smaller rank (found by trying every size in one process),
and both Trainers are set to it.

GPU memory is the one thing stood in for: a forward pre-hook takes 2 MiB per sequence of the
batch from vramkit's cpu pool for the length of the forward pass, and each rank's pool is capped
(rank 0 at 64 MiB, rank 1 at 112 MiB), so a batch too large raises vramkit's OutOfMemoryError
inside the Trainer's forward, with DDP's collectives around it, as a GPU's allocator would."""

from __future__ import annotations

import textwrap

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from torchrun_jobs import launch  # noqa: E402

LIMITS_MIB = (64, 112)

WORKER = textwrap.dedent(r"""
    import json, os, sys, tempfile
    import torch, transformers
    import vramkit
    from vramkit.integrations import transformers as vhf

    mode, limit_mib = sys.argv[1], int(sys.argv[2])
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    vramkit.set_memory_limit(limit_mib << 20, "cpu")
    VOCAB, SEQ = 64, 8

    class Tokens(torch.utils.data.Dataset):
        def __init__(self, n):
            self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(0))
        def __len__(self):
            return len(self.ids)
        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=VOCAB,
                                                                 n_positions=SEQ, bos_token_id=0, eos_token_id=0))
    held = []
    def take(module, args, kwargs):  # the stand-in for activation memory: 2 MiB a sequence
        held.append(vramkit.raw_alloc(kwargs["input_ids"].shape[0] << 21, "cpu"))
    def give(module, args, kwargs, output):
        vramkit.raw_free(held.pop())
    model.register_forward_pre_hook(take, with_kwargs=True)
    model.register_forward_hook(give, with_kwargs=True)

    if mode == "reference":  # every size in turn, one process, no search
        best = 0
        for bs in range(1, 257):
            try:
                take(None, (), {"input_ids": torch.zeros(bs, SEQ)})
                give(None, (), {}, None)
            except vramkit.OutOfMemoryError:
                break
            finally:
                vramkit.empty_cache("cpu")
            best = bs
        print("RESULT " + json.dumps({"batch_size": best}), flush=True)
        sys.exit(0)

    out = tempfile.mkdtemp()
    args = transformers.TrainingArguments(output_dir=out, per_device_train_batch_size=1, max_steps=2, report_to=[],
                                          save_strategy="no", disable_tqdm=True, use_cpu=True, ddp_backend="gloo",
                                          learning_rate=1e-3)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(512))
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    result = vhf.find_trainer_batch_size(trainer, max_batch_size=256)
    same = all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())
    print("RESULT " + json.dumps({"batch_size": result.batch_size, "set": args.per_device_train_batch_size,
                                  "weights_unchanged": same, "world": args.world_size,
                                  "limit_after": vramkit.get_settings("cpu")["memory_limit"],
                                  "outcomes": [[a.batch_size, a.outcome, a.local_outcome] for a in result.attempts]}),
          flush=True)
    import torch.distributed as dist
    dist.destroy_process_group()
""")


def test_ddp_ranks_with_different_memory_set_the_same_size(tmp_path):
    want = launch(tmp_path / "ref", WORKER, "reference", [min(LIMITS_MIB)], deadline=120)[0]["batch_size"]
    assert 0 < want < 256
    ranks = launch(tmp_path, WORKER, "ddp", LIMITS_MIB, deadline=300)
    assert [r["world"] for r in ranks] == [2, 2]
    assert [r["batch_size"] for r in ranks] == [want, want]
    assert [r["set"] for r in ranks] == [want, want]
    assert all(r["weights_unchanged"] for r in ranks)
    assert ranks[0]["outcomes"] == [[b, o, ranks[0]["outcomes"][i][2]] for i, (b, o, _) in enumerate(ranks[1]["outcomes"])]
    assert any(local == "oom" for _, _, local in ranks[1]["outcomes"])  # the larger rank ran out with the smaller
    assert [r["limit_after"] for r in ranks] == [m << 20 for m in LIMITS_MIB]
