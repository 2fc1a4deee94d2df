"""Your own data for a KAN: pykan's create_dataset, CSV / NPY / NPZ tables (columns by name or position), a seeded
train/test split, standardisation from the training split only, per-target RMSE in the targets' units, the CLI's
data.path, and fit(params, dataset) on the training engine."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxgrad.kan as kan
from jaxgrad.cli import main
from jaxgrad.kan.data import Standardizer, dataset_from_file, read_table, split_indices
from jaxgrad.kan.task import KANFit, make_task
from jaxgrad.train import DataError


def _f(x):
    return jnp.exp(jnp.sin(jnp.pi * x[:, [0]]) + x[:, [1]] ** 2)


# ---------------------------------------------------------------------------------------------------------------
# create_dataset
# ---------------------------------------------------------------------------------------------------------------

def test_create_dataset_reads_like_pykans():
    ds = kan.create_dataset(_f, n_var=2, train_num=50, test_num=20, seed=3)
    assert sorted(ds) == ["test_input", "test_label", "train_input", "train_label"]
    assert ds["train_input"].shape == (50, 2) and ds["train_label"].shape == (50, 1)
    assert ds["test_input"].shape == (20, 2)
    np.testing.assert_allclose(ds["train_label"], np.asarray(_f(jnp.asarray(ds["train_input"]))), rtol=1e-6)
    again = kan.create_dataset(_f, n_var=2, train_num=50, test_num=20, seed=3)
    np.testing.assert_array_equal(ds["train_input"], again["train_input"])
    other = kan.create_dataset(_f, n_var=2, train_num=50, test_num=20, seed=4)
    assert not np.array_equal(ds["train_input"], other["train_input"])


def test_create_dataset_ranges_per_variable_row_mode_and_1d_labels():
    ds = kan.create_dataset(lambda x: x[0] * x[1], n_var=2, f_mode="row", ranges=[[0, 1], [-5, -3]], train_num=200,
                            test_num=10)
    x = ds["train_input"]
    assert 0 <= x[:, 0].min() and x[:, 0].max() <= 1 and -5 <= x[:, 1].min() and x[:, 1].max() <= -3
    np.testing.assert_allclose(ds["train_label"][:, 0], x[:, 0] * x[:, 1], rtol=1e-6)  # [N] labels become [N, 1]
    with pytest.raises(ValueError, match="'ranges' must be"):
        kan.create_dataset(_f, n_var=2, ranges=[[0, 1]])


def test_normalisation_uses_the_training_split_only():
    raw = kan.create_dataset(_f, n_var=2, train_num=100, test_num=100, seed=1)
    ds = kan.create_dataset(_f, n_var=2, train_num=100, test_num=100, seed=1, normalize_input=True,
                            normalize_label=True)
    st = ds["stats"]
    np.testing.assert_allclose(st.input_mean, raw["train_input"].mean(0), rtol=1e-5)
    np.testing.assert_allclose(ds["train_input"].mean(0), 0, atol=1e-5)
    np.testing.assert_allclose(ds["train_input"].std(0), 1, rtol=1e-4)
    assert np.abs(ds["test_input"].mean(0)).max() > 1e-3          # the test split is not re-centred on itself
    np.testing.assert_allclose(st.invert_targets(ds["test_label"]), raw["test_label"], rtol=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# files
# ---------------------------------------------------------------------------------------------------------------

@pytest.fixture
def table():
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, (40, 3))
    y = np.stack([np.sin(x[:, 0]) + x[:, 1], x[:, 2] ** 2], axis=1)
    return x, y


def test_csv_with_header_columns_by_name_and_by_position(tmp_path, table):
    x, y = table
    p = tmp_path / "d.csv"
    np.savetxt(p, np.concatenate([x, y], 1), delimiter=",", header="a,b,c,u,v", comments="")
    t = read_table(p, inputs=["a", "c"], targets=["v"])
    np.testing.assert_allclose(t.x, x[:, [0, 2]])
    np.testing.assert_allclose(t.y, y[:, [1]])
    assert t.input_names == ("a", "c") and t.target_names == ("v",)
    t = read_table(p, targets=[3, 4])                     # positions; inputs: every other column
    assert t.input_names == ("a", "b", "c") and t.target_names == ("u", "v")
    t = read_table(p)                                     # default: the last column is the target
    assert t.target_names == ("v",) and t.x.shape == (40, 4)
    with pytest.raises(DataError, match=r"no column 'w'; the file has \['a', 'b', 'c', 'u', 'v'\]"):
        read_table(p, targets=["w"])
    with pytest.raises(DataError, match="both inputs and targets"):
        read_table(p, inputs=["a", "u"], targets=["u"])


def test_csv_without_header_npy_and_npz(tmp_path, table):
    x, y = table
    np.savetxt(tmp_path / "n.csv", np.concatenate([x, y], 1), delimiter=",")
    t = read_table(tmp_path / "n.csv", targets=[-2, -1])
    np.testing.assert_allclose(t.y, y)
    np.testing.assert_allclose(t.x, x)
    np.save(tmp_path / "d.npy", np.concatenate([x, y], 1))
    np.testing.assert_allclose(read_table(tmp_path / "d.npy", targets=[3, 4]).y, y)
    with pytest.raises(DataError, match="no column names: use positions"):
        read_table(tmp_path / "d.npy", targets=["u"])
    np.savez(tmp_path / "d.npz", x=x, y=y[:, 0], z=y[:, 1])
    t = read_table(tmp_path / "d.npz", inputs="x", targets=["y", "z"])   # a 2-D array's name picks its columns
    np.testing.assert_allclose(t.x, x)
    np.testing.assert_allclose(t.y, y)
    assert t.input_names == ("x[0]", "x[1]", "x[2]") and t.target_names == ("y", "z")


def test_values_that_are_not_finite_are_refused_never_dropped(tmp_path, table):
    x, y = table
    data = np.concatenate([x, y], 1)
    data[7, 1] = np.nan
    np.savetxt(tmp_path / "bad.csv", data, delimiter=",", header="a,b,c,u,v", comments="")
    with pytest.raises(DataError, match="1 of 40 rows hold a value that is not finite.*row 7, column b"):
        read_table(tmp_path / "bad.csv")
    (tmp_path / "text.csv").write_text("a,b\n1,2\n3,x\n")
    with pytest.raises(DataError, match="every field below the header must be a number"):
        read_table(tmp_path / "text.csv")
    with pytest.raises(DataError, match="the format follows the extension"):
        read_table(tmp_path / "d.parquet")


def test_split_is_seeded_disjoint_and_complete():
    tr, te = split_indices(50, 0.2, seed=1)
    assert len(te) == 10 and len(tr) == 40 and sorted(np.concatenate([tr, te]).tolist()) == list(range(50))
    tr2, te2 = split_indices(50, 0.2, seed=1)
    np.testing.assert_array_equal(te, te2)
    assert not np.array_equal(te, split_indices(50, 0.2, seed=2)[1])


def test_standardised_file_dataset_keeps_train_statistics_to_map_back(tmp_path, table):
    x, y = table
    np.savetxt(tmp_path / "d.csv", np.concatenate([x, y], 1), delimiter=",", header="a,b,c,u,v", comments="")
    ds = dataset_from_file(tmp_path / "d.csv", targets=["u", "v"], test_fraction=0.25, seed=0, standardize="both")
    tr, te = split_indices(40, 0.25, 0)
    st = ds["stats"]
    np.testing.assert_allclose(st.target_mean, y[tr].mean(0))
    np.testing.assert_allclose(st.target_std, y[tr].std(0))
    np.testing.assert_allclose(st.invert_targets(ds["test_label"]), y[te], rtol=1e-5, atol=1e-6)  # float32
    assert Standardizer.from_dict(json.loads(json.dumps(st.to_dict()))).target_std.tolist() == st.target_std.tolist()


def test_per_target_rmse_is_in_the_targets_own_units(tmp_path, table):
    x, y = table
    y = y * np.array([1.0, 100.0])  # two targets on different scales
    np.savetxt(tmp_path / "d.csv", np.concatenate([x, y], 1), delimiter=",", header="a,b,c,u,v", comments="")
    ds = dataset_from_file(tmp_path / "d.csv", targets=["u", "v"], standardize="targets", dtype="float32")
    task = make_task(KANFit(target=None, widths=(3, 2), grids=(3,)), 10, ds)
    params = task.init(jax.random.key(0))
    ev = task.evaluate(params)
    pred = ds["stats"].invert_targets(np.asarray(kan.kan_apply_reference(params, jnp.asarray(ds["test_input"]))))
    truth = ds["stats"].invert_targets(ds["test_label"])
    expect = np.sqrt(np.mean((pred - truth) ** 2, axis=0))
    np.testing.assert_allclose([ev["test_rmse/u"], ev["test_rmse/v"]], expect, rtol=1e-5)
    assert ev["test_rmse/v"] > 10 * ev["test_rmse/u"]


# ---------------------------------------------------------------------------------------------------------------
# the CLI and fit()
# ---------------------------------------------------------------------------------------------------------------

def _csv(tmp_path, table):
    x, y = table
    p = tmp_path / "d.csv"
    np.savetxt(p, np.concatenate([x, y], 1), delimiter=",", header="a,b,c,u,v", comments="")
    return p


SMALL = ["--set", "model.dtype=float32", "--set", "model.grids=[3]", "--set", "train.optimizer=adam",
         "--set", "train.lr=0.01", "--set", "train.lbfgs_warmup_steps=0", "--set", "train.steps=3", "--no-progress"]


def test_cli_trains_on_a_csv_and_reports_per_target_rmse(tmp_path, table, capsys):
    out = tmp_path / "run"
    rc = main(["train", "kan", "--set", f"data.path={_csv(tmp_path, table)}", "--set", 'data.targets=["u","v"]',
               "--set", "model.widths=[3,2]", "--set", "data.standardize=both", *SMALL, "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "40 rows; inputs ['a', 'b', 'c'], targets ['u', 'v']; 32 train / 8 test" in printed
    summary = json.loads((out / "summary.json").read_text())
    assert {"test_rmse/u", "test_rmse/v"} <= set(summary["eval"])
    rec = json.loads((out / "data.json").read_text())
    assert rec["targets"] == ["u", "v"] and rec["train"] == 32 and len(rec["standardizer"]["target_std"]) == 2
    end = [json.loads(s) for s in (out / "metrics.jsonl").read_text().splitlines()][-1]
    assert "test_rmse/u" in end["eval"]


@pytest.mark.parametrize("extra, message", [
    (["--set", "data.target=sin_pi_x"], "data.target = 'sin_pi_x' is not used with data.path"),
    (["--set", "model.widths=[2,1]"], "the data has 4 inputs but 'widths' = \\[2, 1\\] starts with 2"),
    (["--set", "data.targets=[\"w\"]"], "no column 'w'"),
])
def test_cli_refuses_what_the_data_cannot_use(tmp_path, table, capsys, extra, message):
    import re

    out = tmp_path / "run"
    rc = main(["train", "kan", "--set", f"data.path={_csv(tmp_path, table)}", "--set", "model.widths=[4,1]", *extra,
               *SMALL, "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and re.search(message, err) and err.count("\n") == 1, err
    assert not out.exists()


def test_cli_refuses_file_keys_without_a_file(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "kan", "--set", "data.standardize=both", *SMALL, "--out", str(out)]) == 2
    assert "data.standardize = 'both' is not used without data.path" in capsys.readouterr().err


def test_fit_reads_like_pykans_and_lowers_the_test_loss():
    ds = kan.create_dataset(_f, n_var=2, train_num=200, test_num=100, seed=0)
    params = kan.kan_init(jax.random.key(0), [2, 1, 1], grid_size=3, init="pykan")
    new, results = kan.fit(params, ds, steps=60, opt="Adam", lr=0.1, update_grid=False, log=20)
    assert results["step"] == [20, 40, 60] and len(results["train_loss"]) == len(results["test_loss"]) == 3
    assert results["test_loss"][-1] < 0.5 * results["test_loss"][0]   # measured 0.88 -> 0.20
    # L-BFGS after an Adam warm-up, grid updates as pykan's arguments say (at steps 0 and 20): measured 0.23
    _, results = kan.fit(params, ds, steps=60, warmup_steps=20, grid_update_num=2, stop_grid_update_step=40,
                         grid_eps=1.0, log=30)
    assert results["step"] == [30, 60] and results["test_loss"][-1] < 0.4
    assert results["eval"]["test_rmse"] == pytest.approx(results["test_loss"][-1])
    assert [p["spline_weight"].shape for p in new] == [p["spline_weight"].shape for p in params]
    with pytest.raises(ValueError, match="'lr' = 0.1 is not used by optimizer 'lbfgs'"):
        kan.fit(params, ds, steps=5, opt="LBFGS", lr=0.1)
    with pytest.raises(ValueError, match="'opt' must be one of"):
        kan.fit(params, ds, opt="Newton")
    with pytest.raises(ValueError, match=r"grid updates every stop_grid_update_step // grid_update_num = 5 // 10 = 0"):
        kan.fit(params, ds, stop_grid_update_step=5)   # pykan divides by zero there
