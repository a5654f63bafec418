import importlib.util
import pathlib

import jax.numpy as jnp
import numpy as np

from kernels_pallas.layout import bytes_per_block

_path = pathlib.Path(__file__).parents[2] / "scripts" / "simulate_batching.py"
_spec = importlib.util.spec_from_file_location("simulate_batching", _path)
sim = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sim)

LENGTHS = [32, 128, 64, 256]


def test_static_batching_efficiency():
    useful, reserved = sim.static_batching_efficiency(LENGTHS)
    assert (useful, reserved) == (480, 1024)
    assert f"{useful / reserved:.1%}" == "46.9%"


def test_continuous_blocks_follow_each_request_until_it_finishes():
    blocks = sim.continuous_blocks_in_use(LENGTHS, 16)
    assert blocks.shape == (256,)
    # Step t holds ceil(t / 16) blocks for each request still running at t.
    t = np.arange(1, 257)[:, None]
    expected = np.where(t <= np.array(LENGTHS), -(-t // 16), 0).sum(axis=1)
    np.testing.assert_array_equal(blocks, expected)
    assert blocks.max() == 16 and blocks.sum() == 2960  # mean 11.5625
    assert (blocks[[0, 15, 16, 32, 128]] == [4, 4, 8, 9, 9]).all()


def test_static_blocks_reserve_the_longest_length_for_everyone():
    blocks = sim.static_blocks_in_use(LENGTHS, 16)
    assert blocks.shape == (256,) and (blocks == 64).all()


def test_prefix_sharing_counts_blocks_with_refcounts():
    shared = sim.prefix_sharing(16, 200, 16)
    assert shared.prompt_blocks == 13
    assert (shared.blocks_unshared, shared.blocks_shared, shared.references) == (208, 13, 208)
    # The partial 13th block is copied for all but the conversation holding its last reference.
    assert (shared.copies, shared.blocks_after_first_token) == (15, 12 + 16)


def test_memory_math():
    block_bytes = bytes_per_block(32, 16, 8, 128, jnp.float16)
    assert block_bytes == 2_097_152
    assert sim.blocks_in_budget(60 * 10**9, block_bytes) == 28_610
    assert sim.blocks_in_budget(60 * 2**30, block_bytes) == 30_720


def test_main_prints_the_table_and_writes_the_plot(tmp_path, capsys):
    sim.main(["--out-dir", str(tmp_path / "plots")])
    out = capsys.readouterr().out
    for line in [
        "useful token slots 480 of 1,024 reserved (46.9%)",
        "static (each reserves 256 tokens)           64   64.00",
        "continuous (on demand, freed at finish)     16   11.56",
        "blocks without sharing                     208",
        "blocks with share()                         13   refcounts sum to 208",
        "bytes per block                              2,097,152",
        "blocks in 60 GB  (60,000,000,000 bytes)         28,610",
        "blocks in 60 GiB (64,424,509,440 bytes)         30,720",
    ]:
        assert line in out
    png = tmp_path / "plots" / "blocks_in_use.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
