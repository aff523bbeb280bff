"""The validation helpers of `eqxscan/_helpers/checks.py`."""

import jax
import numpy as np
import pytest

from eqxscan._helpers.checks import describe, split_key


def test_split_key_accepts_one_key_of_either_kind():
    typed = split_key(jax.random.key(0), 3, "Stacked")
    assert typed.shape == (3,)
    assert (
        jax.random.key_data(typed)
        == jax.random.key_data(jax.random.split(jax.random.key(0), 3))
    ).all()
    raw = split_key(jax.random.PRNGKey(0), 3, "Stacked")
    assert raw.shape == (3, 2)


@pytest.mark.parametrize(
    "key, shown, hint",
    [
        (0, "got 0.", "pass one key (jax.random.key(seed))"),
        (np.zeros(3, np.uint32), "got uint32[3].", "pass one key"),
        (None, "got None.", "pass one key"),
        (jax.random.split(jax.random.key(0), 4), "got key<fry>[4].", "not a batch"),
    ],
)
def test_split_key_names_what_it_got(key, shown, hint):
    with pytest.raises(TypeError) as info:
        split_key(key, 3, "Stacked(make_layer, 3)")
    headline, hint_line = str(info.value).split("\n")
    assert headline.startswith("Stacked(make_layer, 3) needs `key` to be one JAX PRNG")
    assert headline.endswith(shown)
    assert hint_line.startswith("Hint:") and hint in hint_line


def test_describe_reads_key_arrays():
    assert describe(jax.random.split(jax.random.key(0), 2)) == "key<fry>[2]"
    assert describe(np.zeros((2, 3), np.float32)) == "float32[2,3]"


def test_entry_points_name_a_wrong_key():
    import equinox as eqx
    import jax.numpy as jnp

    import eqxscan

    batch = jax.random.split(jax.random.key(0), 3)
    with pytest.raises(TypeError, match="key"):
        eqxscan.Stacked(lambda k: eqx.nn.Linear(2, 2, key=k), 3, key=0)
    stack = eqxscan.Stacked(
        lambda k: eqx.nn.Linear(2, 2, key=k), 3, key=jax.random.key(0)
    )
    with pytest.raises(TypeError, match="key"):
        stack(jnp.ones(2), key=batch)
    rnn = eqxscan.Recurrent(eqxscan.ElmanCell(2, 2, key=jax.random.key(0)))
    with pytest.raises(TypeError, match="key"):
        rnn(jnp.zeros(2), jnp.ones((4, 2)), key=np.zeros(3, np.uint32))
