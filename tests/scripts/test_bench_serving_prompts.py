"""scripts/bench_serving.py sends each rate prompts that no earlier rate sent, so that a server's prefix
cache does not skip the later rates' prefills."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "scripts"))
import bench_serving  # noqa: E402


def test_each_turn_sends_prompts_no_earlier_turn_sent():
    requests = [dict(id=i, prompt_token_ids=[1000 + 7 * i + 3 * t for t in range(40)], max_new_tokens=4)
                for i in range(3)]
    turns = [bench_serving.unseen(requests, turn) for turn in range(5)]
    assert turns[0] == requests
    for i, request in enumerate(requests):
        prompts = [turn[i]["prompt_token_ids"] for turn in turns]
        assert len({p[0] for p in prompts}) == len(prompts)  # no two turns share even a first token
        assert all(sorted(p) == sorted(request["prompt_token_ids"]) for p in prompts)
        assert all(turn[i]["max_new_tokens"] == 4 and turn[i]["id"] == i for turn in turns)
