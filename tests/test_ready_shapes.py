"""The bucket chooser during a background warm-up: a batch takes the smallest compiled shape of its
call and query layout that holds its tokens, rows and block-table columns."""

from serve.core.runner.ready_shapes import ReadyShapes, Shape, resample_shape


def ready(*shapes: Shape) -> ReadyShapes:
    out = ReadyShapes()
    out.complete = False
    for s in shapes:
        out.add(s)
    return out


def test_a_complete_set_gives_the_batch_its_own_shape():
    need = Shape("step", 2, 2, 16, 1)
    assert ReadyShapes().pick(need) == need


def test_the_smallest_ready_decode_shape_that_holds_the_batch():
    shapes = ready(Shape("step", 128, 128, 16, 1), Shape("step", 8, 8, 16, 1), Shape("step", 4, 4, 4, 1))
    assert shapes.pick(Shape("step", 2, 2, 16, 1)) == Shape("step", 8, 8, 16, 1)  # (4, 4, 4) is too narrow
    assert shapes.pick(Shape("step", 16, 16, 16, 1)) == Shape("step", 128, 128, 16, 1)
    assert shapes.pick(Shape("loop", 2, 2, 16, 1)) == Shape("loop", 2, 2, 16, 1)  # none ready holds it


def test_a_prompt_chunk_takes_a_mixed_shape_and_a_decode_a_per_row_one():
    mixed, decode = Shape("step", 64, 16, 16, 64), Shape("step", 64, 64, 16, 1)
    shapes = ready(mixed, decode, Shape("step", 512, 128, 16, 512))
    assert shapes.pick(Shape("step", 32, 16, 16, 32), mixed=True) == mixed
    assert shapes.pick(Shape("step", 16, 16, 16, 1)) == decode
    verify = ready(Shape("verify", 16, 4, 16, 4), Shape("verify", 16, 1, 16, 16), Shape("verify", 32, 8, 16, 4))
    assert verify.pick(Shape("verify", 8, 2, 16, 4)) == Shape("verify", 16, 4, 16, 4)
    assert verify.pick(Shape("verify", 16, 1, 16, 16), mixed=True) == Shape("verify", 16, 1, 16, 16)


def test_a_batch_that_resamples_needs_the_resampler_of_its_rows():
    small, large = Shape("step", 4, 4, 16, 1), Shape("step", 8, 8, 16, 1)
    shapes = ready(small, large, resample_shape(8))
    assert shapes.pick(Shape("step", 2, 2, 16, 1)) == small
    assert shapes.pick(Shape("step", 2, 2, 16, 1), resample=True) == large
