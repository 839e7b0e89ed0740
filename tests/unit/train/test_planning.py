"""The gathered row of step figures: named fields that travel as one float64 row and read back as they left."""

from hypothesis import given
from hypothesis import strategies as st

from hetdp.train.planning import FiguresRow

seconds = st.floats(min_value=0.0, max_value=1e4, allow_nan=False)


@given(steps=st.integers(0, 6), data=st.data())
def test_a_row_reads_back_as_it_was_gathered(steps, data):
    row = FiguresRow(horizon=data.draw(st.integers(0, 10**6)),
                     compute_s=data.draw(st.lists(seconds, min_size=steps, max_size=steps)),
                     wait_s=data.draw(st.lists(seconds, min_size=steps, max_size=steps)),
                     samples=data.draw(st.lists(st.integers(0, 10**5), min_size=steps, max_size=steps)),
                     extra=data.draw(st.lists(seconds, max_size=6)))
    values = row.values()
    assert len(values) == 1 + 3 * steps + len(row.extra)
    assert FiguresRow.of(values, steps) == row


def test_the_fields_keep_their_places_in_the_row():
    row = FiguresRow(horizon=7, compute_s=[0.5, 0.25], wait_s=[0.125, 0.0], samples=[3, 5], extra=[9.0])
    assert row.values() == [7.0, 0.5, 0.25, 0.125, 0.0, 3.0, 5.0, 9.0]
