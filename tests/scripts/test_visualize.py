"""scripts/visualize.py on a small workload: the files are written, and the occupancy they show is the
replay's own, step by step (paged runs) or simulate.py's reservations (static run)."""

import json
import pathlib
import re
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "scripts"))
import visualize  # noqa: E402

ARGS = ["--num-requests", "10", "--num-blocks", "96", "--block-size", "16", "--max-model-len", "1024",
        "--max-frames", "40"]


def test_frames_are_the_replays_occupancy():
    args = visualize.parse_args(ARGS)
    requests = visualize.load_requests(args)
    for sharing in (False, True):
        frames, result = visualize.paged_run(requests, args, prefix_sharing=sharing)
        assert len(frames) == len(result.step_time)
        assert [f["slots"] for f in frames] == result.slots_in_use.tolist()
        assert [f["tokens"] for f in frames] == result.tokens_held.tolist()
        assert [f["running"] for f in frames] == result.num_running.tolist()
        used = [f["used"] for f in frames]
        per_sequence = [f["slots"] // args.block_size for f in frames]
        if sharing:  # a physical block shared by several requests is one block in the pool
            assert result.prefix_hit_tokens > 0
            assert all(u <= p for u, p in zip(used, per_sequence)) and used != per_sequence
        else:
            assert used == per_sequence
        for f in frames:
            assert len(f["cells"]) == args.num_blocks and f["cells"][0] == "x"
            assert f["cells"].count("h") + f["cells"].count("s") == f["used"]


def test_static_reservation_reserves_the_context_length_for_each_running_request():
    args = visualize.parse_args(ARGS)
    frames = visualize.static_run(visualize.load_requests(args), args)
    reserve = 1024 // 16
    assert all(f["used"] == f["running"] * reserve for f in frames)
    assert max(f["running"] for f in frames) == (args.num_blocks - 1) // reserve


def test_writes_the_png_and_a_self_contained_animation(tmp_path):
    summary = visualize.main([*ARGS, "--out-dir", str(tmp_path)])
    png, page = tmp_path / "occupancy.png", (tmp_path / "occupancy.html").read_text()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page)  # nothing fetched from elsewhere
    data = json.loads(re.search(r"const DATA = (\{.*?\});\n", page).group(1))
    assert [s["name"] for s in data["scenarios"]] == list(summary)
    args = visualize.parse_args(ARGS)
    frames, _ = visualize.paged_run(visualize.load_requests(args), args, prefix_sharing=False)
    shown = data["scenarios"][1]
    assert shown["done"] == len(frames) == summary["paged"]["steps"]
    assert [f["used"] for f in shown["frames"]] == [frames[min(i, len(frames) - 1)]["used"] for i in data["steps"]]
    # Paging runs the batch in fewer steps than reserving the context length for every request.
    assert summary["paged"]["steps"] < summary["static reservation"]["steps"]
    assert summary["paged"]["slot_waste"] < summary["static reservation"]["slot_waste"]
