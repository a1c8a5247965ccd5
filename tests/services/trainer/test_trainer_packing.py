"""Token-budget micro-batches and padding-free (one-row, varlen attention) forwards: the
plan's invariants, and equality with the fixed-row, right-padded path on tiny models."""

import random

import pytest
import torch
from trainer_helpers import make_batch, trainer_config

from meshrl.ragged import Ragged
from meshrl.testing.tiny_model import make_tiny_qwen2_dir
from services.trainer.actor import ActorRole
from services.trainer.critic import CriticRole
from services.trainer.forward import response_logprobs, response_values
from services.trainer.micro_batches import first_fit_decreasing, plan_epoch
from services.trainer.model_loading import load_policy_model, load_value_model
from services.trainer.padding_free import flatten_sequences
from services.trainer.reference import RefRole
from services.trainer.sequences import pack_sequences
from services.trainer.types import SequenceBatch

# --- planning -------------------------------------------------------------------------


def test_first_fit_decreasing_by_hand():
    tokens = dict(enumerate([5, 4, 3, 3, 2, 1, 12]))
    # Decreasing: 12 (over the budget: alone), 5, 4, 3, 3, 2, 1 into bins of 8:
    # [12] | 5+3 | 4+3+1 | 2  (the 2 fits nowhere: 8, 8 are full)
    assert first_fit_decreasing(list(tokens), tokens, 8) == [[6], [0, 2], [1, 3, 5], [4]]


def _check_plan(response_lengths, sequence_lengths, mini_rows, budget, world_size, seed):
    plans = [
        plan_epoch(
            response_lengths,
            mini_rows,
            1,
            shuffle=True,
            seed=seed,
            rank=rank,
            world_size=world_size,
            max_tokens=budget,
            sequence_lengths=sequence_lengths,
        )
        for rank in range(world_size)
    ]
    seen = []
    for i, mini in enumerate(plans[0]):
        minis = [plan[i] for plan in plans]
        assert len({len(m.micro_batches) for m in minis}) == 1, "same count on every rank"
        assert all(torch.equal(m.rows, mini.rows) for m in minis)
        assert mini.token_count == int(response_lengths[mini.rows].sum())
        assert mini.seq_count == mini.rows.numel()
        rows_here = []
        for m in minis:
            for micro in m.micro_batches:
                if micro.weight == 0.0:
                    assert micro.rows.numel() == 1  # padding: one row, no contribution
                    continue
                tokens = int(sequence_lengths[micro.rows].sum())
                assert tokens <= budget or micro.rows.numel() == 1
                rows_here += micro.rows.tolist()
        assert sorted(rows_here) == sorted(mini.rows.tolist()), "each row exactly once"
        seen += rows_here
    assert sorted(seen) == list(range(response_lengths.numel()))


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("seed", range(4))
def test_token_budget_plan_invariants(world_size, seed):
    rng = random.Random(seed)
    b = rng.randint(5, 40)
    prompts = torch.tensor([rng.randint(1, 30) for _ in range(b)])
    responses = torch.tensor([rng.randint(1, 50) for _ in range(b)])
    budget = rng.choice([60, 100, 200])  # 60: some rows (up to 80 tokens) exceed it
    _check_plan(responses, prompts + responses, rng.randint(3, 16), budget, world_size, seed)


def test_an_overlong_row_gets_a_micro_batch_of_its_own():
    responses = torch.tensor([2, 50, 3])
    (mini,) = plan_epoch(responses, 3, 1, max_tokens=20, sequence_lengths=responses + 1)
    parts = sorted(m.rows.tolist() for m in mini.micro_batches)
    assert parts == [[0, 2], [1]]  # 3 + 4 tokens share one; 51 > 20 stands alone


def _two_rank_plans(lengths, budget):
    return [
        plan_epoch(
            lengths,
            len(lengths),
            1,
            rank=r,
            world_size=2,
            max_tokens=budget,
            sequence_lengths=lengths,
        )[0].micro_batches
        for r in (0, 1)
    ]


def test_a_rank_needing_fewer_micro_batches_splits_before_it_pads():
    # Shares balanced by tokens (longest first, to the lighter rank): rank 0 gets rows
    # 0, 3, 5 (70 + 20 + 20 = 110 tokens: two micro-batches of at most 100), rank 1 rows
    # 1, 2, 4 (60 + 20 + 20 = 100: one). Rank 1 must run two as well: it halves its one
    # micro-batch (60 | 20 + 20) rather than running a zero-weight one.
    plans = _two_rank_plans(torch.tensor([70, 60, 20, 20, 20, 20]), 100)
    assert [[m.rows.tolist() for m in p] for p in plans] == [[[0, 3], [5]], [[1], [2, 4]]]
    assert all(m.weight == 1.0 for p in plans for m in p)


def test_a_rank_with_one_row_pads_with_the_shortest_row():
    # Rank 0 gets row 0 (90 tokens), rank 1 rows 1 and 2 (60 + 50 > 100: two micro-
    # batches). Rank 0 cannot split one row: its second micro-batch is the mini-batch's
    # shortest row (2) at weight 0.
    plans = _two_rank_plans(torch.tensor([90, 60, 50]), 100)
    assert [[(m.rows.tolist(), m.weight) for m in p] for p in plans] == [
        [([0], 1.0), ([2], 0.0)],
        [([1], 1.0), ([2], 1.0)],
    ]


# --- padding-free layout ---------------------------------------------------------------


def test_flatten_sequences_by_hand():
    batch = SequenceBatch(Ragged.from_lists([[5, 6], [7]]), Ragged.from_lists([[8, 9, 10], [11]]))
    flat = flatten_sequences(batch)
    assert flat.input_ids.tolist() == [[5, 6, 8, 9, 10, 7, 11]]
    assert flat.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1]]
    assert flat.cu_seq_lens.tolist() == [0, 5, 7]
    assert flat.cu_seq_lens.dtype == torch.int32
    assert flat.max_length == 5
    # Token 8 is predicted at position 1 (the 6), 9 at 2, 10 at 3; 11 at 5 (the 7).
    assert flat.predictor_index.tolist() == [1, 2, 3, 5]
    assert flat.kept_labels().tolist() == [[8, 9, 10, 11]]
    kept = torch.tensor([[10.0, 20.0, 30.0, 40.0]])  # one output per kept position
    out = flat.at_responses(kept)
    assert out[flat.response_mask].tolist() == [10.0, 20.0, 30.0, 40.0]
    every = torch.arange(7.0).unsqueeze(0)  # one output per position of the row
    assert flat.at_responses(every)[flat.response_mask].tolist() == [1.0, 2.0, 3.0, 5.0]


@pytest.fixture(scope="module")
def gqa_model_dir(tmp_path_factory):
    """A tiny Qwen2 with grouped-query attention (4 query heads over 2 kv heads)."""
    path = tmp_path_factory.mktemp("tiny_qwen2")
    return make_tiny_qwen2_dir(
        path,
        tokenizer=False,
        vocab_size=32,
        hidden=32,
        intermediate=64,
        max_positions=128,
        tie_word_embeddings=False,
    )


def _ragged_batch(seed: int, rows: int = 7) -> SequenceBatch:
    """Prompts of 1-9 tokens, responses of 1-12 with at least two of length 1."""
    g = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(4, 22, (int(torch.randint(1, 10, (1,), generator=g)),), generator=g)
        for _ in range(rows)
    ]
    lens = [1, 1] + [int(torch.randint(1, 13, (1,), generator=g)) for _ in range(rows - 2)]
    responses = [torch.randint(4, 22, (n,), generator=g) for n in lens]
    return SequenceBatch(Ragged.from_tensors(prompts), Ragged.from_tensors(responses))


@pytest.mark.parametrize("model", ["llama", "qwen2_gqa"])
@pytest.mark.parametrize("chunked_head", [True, False])
def test_padding_free_scores_equal_the_padded_ones(
    tiny_model_dir, gqa_model_dir, model, chunked_head
):
    path = str(tiny_model_dir if model == "llama" else gqa_model_dir)
    padded_model = load_policy_model(path).eval()
    flat_model = load_policy_model(path, remove_padding=True).eval()
    assert flat_model.config._attn_implementation == "meshrl_varlen"
    if not chunked_head:  # the plain LM head: full logits at the kept positions
        for m in (padded_model, flat_model):
            head = m.lm_head
            m.lm_head = torch.nn.Linear(head.in_features, head.out_features, bias=False)
            m.lm_head.weight = head.weight
    for seed in range(3):
        batch = _ragged_batch(seed)
        padded = pack_sequences(batch)
        with torch.no_grad():
            want = response_logprobs(padded_model, padded, 0.8, with_entropy=True)
            got = response_logprobs(flat_model, flatten_sequences(batch), 0.8, with_entropy=True)
        mask = padded.response_mask
        torch.testing.assert_close(got.logprobs[mask], want.logprobs[mask], atol=1e-5, rtol=0)
        torch.testing.assert_close(got.entropy[mask], want.entropy[mask], atol=1e-5, rtol=0)


def test_padding_free_values_equal_the_padded_ones(gqa_model_dir):
    padded_model = load_value_model(str(gqa_model_dir)).eval()
    flat_model = load_value_model(str(gqa_model_dir), remove_padding=True).eval()
    for m in (padded_model, flat_model):  # a non-zero head, so values depend on the input
        torch.nn.init.normal_(m.value_head.weight, generator=torch.Generator().manual_seed(0))
    for seed in range(3):
        batch = _ragged_batch(seed + 10)
        padded = pack_sequences(batch)
        with torch.no_grad():
            want = response_values(padded_model, padded)
            got = response_values(flat_model, flatten_sequences(batch))
        mask = padded.response_mask
        assert want[mask].abs().max() > 1e-3
        torch.testing.assert_close(got[mask], want[mask], atol=1e-5, rtol=0)


# --- whole roles ---------------------------------------------------------------------

LAYOUTS = {
    "rows_padded": [],
    "tokens_padded": ["actor_rollout_ref.actor.use_dynamic_bsz=true"],
    "rows_padding_free": ["actor_rollout_ref.model.use_remove_padding=true"],
    "tokens_padding_free": [
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        "actor_rollout_ref.model.use_remove_padding=true",
    ],
}
# A budget of 24 tokens fits 2-4 of make_batch's rows (2-12 tokens each): micro-batches of
# varying row counts, unlike the fixed 2 rows of the baseline.
BUDGET = [
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=24",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=20",
    "critic.ppo_max_token_len_per_gpu=24",
    "critic.forward_max_token_len_per_gpu=16",
    "critic.model.use_remove_padding={padding_free}",
]


def _config(model_dir, layout: str):
    padding_free = "padding_free" in layout
    overrides = [
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.actor.ppo_epochs=2",
        "actor_rollout_ref.actor.entropy_coeff=0.01",
        *LAYOUTS[layout],
        *(o.format(padding_free=str(padding_free).lower()) for o in BUDGET),
    ]
    return trainer_config(model_dir, overrides)


def _params(role) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in role.model.named_parameters()}


def _assert_same_update(layout, metrics, params, base_metrics, base_params) -> None:
    """Every metric but timing within 1e-5, every parameter within 1e-5 absolute."""
    for key, value in base_metrics.items():
        if not key.startswith("perf/"):
            assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-5), (layout, key)
    for name, p in base_params.items():
        torch.testing.assert_close(params[name], p, atol=1e-5, rtol=0, msg=f"{layout} {name}")


def test_actor_update_is_the_same_in_every_layout(world, tiny_model_dir):
    batch = make_batch(9, seed=11)
    results = {}
    for layout in LAYOUTS:
        cfg = _config(tiny_model_dir, layout)
        actor = ActorRole.build(cfg, world)
        initial = _params(actor)
        old, entropy = actor.compute_log_probs(batch, with_entropy=True)
        adv = old.with_values(torch.linspace(-1, 1, old.values.numel()))
        metrics = actor.update_policy(batch, old, adv, None, None, global_step=1)
        results[layout] = (old.values, entropy.values, metrics, _params(actor))
    base_old, base_ent, base_metrics, base_params = results["rows_padded"]
    for layout, (old, ent, metrics, params) in results.items():
        torch.testing.assert_close(old, base_old, atol=1e-5, rtol=0, msg=layout)
        torch.testing.assert_close(ent, base_ent, atol=1e-5, rtol=0, msg=layout)
        _assert_same_update(layout, metrics, params, base_metrics, base_params)
    assert base_metrics["actor/grad_norm"] > 0
    moved = max(float((base_params[n] - p).abs().max()) for n, p in initial.items())
    assert moved > 1e-4, "the update changed the weights"


def test_critic_update_is_the_same_in_every_layout(world, tiny_model_dir):
    batch = make_batch(9, seed=12)
    results = {}
    for layout in LAYOUTS:
        cfg = _config(tiny_model_dir, layout)
        critic = CriticRole.build(cfg, world)
        with torch.no_grad():  # a non-zero head (the same in every layout): values vary
            critic.model.value_head.weight.fill_(0.1)
        values = critic.compute_values(batch)
        returns = values.with_values(torch.linspace(0.5, 1.5, values.values.numel()))
        metrics = critic.update_value(batch, values, returns, global_step=1)
        results[layout] = (values.values, metrics, _params(critic))
    base_values, base_metrics, base_params = results["rows_padded"]
    assert base_values.abs().max() > 1e-3
    for layout, (values, metrics, params) in results.items():
        torch.testing.assert_close(values, base_values, atol=1e-5, rtol=0, msg=layout)
        _assert_same_update(layout, metrics, params, base_metrics, base_params)


def test_reference_follows_the_actors_dynamic_batching(world, tiny_model_dir):
    cfg = _config(tiny_model_dir, "tokens_padding_free")
    ref = RefRole.build(cfg, world)
    assert ref.forward.padding_free
    assert ref.forward.max_tokens == 24  # ref.log_prob_max_token_len_per_gpu unset: the actor's
    batch = make_batch(7, seed=13)
    got, _ = ref.compute_log_probs(batch)
    want, _ = RefRole.build(_config(tiny_model_dir, "rows_padded"), world).compute_log_probs(batch)
    torch.testing.assert_close(got.values, want.values, atol=1e-5, rtol=0)


def test_padding_free_handles_empty_responses(world, tiny_model_dir):
    # A response of no tokens (row 1): in a micro-batch of its own, its padding-free row
    # keeps no position for the LM head at all. That used to fail in the chunked head
    # (reshape of 0 rows) and in mapping the outputs back; the padded layout always worked.
    prompts = [torch.tensor([5]), torch.tensor([5, 6]), torch.tensor([7])]
    responses = [torch.tensor([4, 5]), torch.zeros(0, dtype=torch.int64), torch.tensor([9, 10])]
    batch = SequenceBatch(Ragged.from_tensors(prompts), Ragged.from_tensors(responses))
    one_row = ["actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1"]
    results = {}
    for layout in ("rows_padded", "rows_padding_free"):
        cfg = trainer_config(tiny_model_dir, one_row + LAYOUTS[layout])
        actor = ActorRole.build(cfg, world)
        old, entropy = actor.compute_log_probs(batch, with_entropy=True)
        adv = old.with_values(torch.linspace(-1, 1, old.values.numel()))
        metrics = actor.update_policy(batch, old, adv, None, None, global_step=1)
        results[layout] = (old.values, entropy.values, metrics, _params(actor))
    base_old, base_ent, base_metrics, base_params = results["rows_padded"]
    old, ent, metrics, params = results["rows_padding_free"]
    assert old.numel() == 4
    torch.testing.assert_close(old, base_old, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, base_ent, atol=1e-5, rtol=0)
    _assert_same_update("rows_padding_free", metrics, params, base_metrics, base_params)
    # Only empty responses: nothing to score, and an update that changes nothing.
    empty = batch.select(torch.tensor([1]))
    flat = flatten_sequences(empty, response_width=3)
    model = load_policy_model(str(tiny_model_dir), remove_padding=True)
    scores = response_logprobs(model, flat, 1.0, with_entropy=True)
    assert scores.logprobs.shape == (1, 3)
    scores.logprobs.sum().backward()  # the graph reaches the weights (FSDP's reduce needs it)
    assert model.lm_head.weight.grad is not None
