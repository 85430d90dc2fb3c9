"""Open Inference Protocol tensors checked against a version's signature
(serving.gateway.inference_protocol): what fits becomes arrays of the right type and shape; what does
not is refused with a message naming the tensor, before anything reaches a model."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from core.errors import InvalidInput
from serving.gateway.inference_protocol import (
    BadRequest,
    BadTensor,
    Part,
    Signature,
    answer_frame,
    decode_inputs,
    encode_outputs,
    frame_head,
    pack_many,
    unpack_answers,
    unpack_many,
)

DIGITS = Signature.from_json({
    "inputs": [{"name": "pixels", "datatype": "FP32", "shape": [-1, 64]}],
    "outputs": [{"name": "probabilities", "datatype": "FP32", "shape": [-1, 10]},
                {"name": "label", "datatype": "INT64", "shape": [-1]}],
})  # fmt: skip
TEXT = Signature.from_json({
    "inputs": [{"name": "text", "datatype": "BYTES", "shape": [-1]},
               {"name": "lang", "datatype": "BYTES", "shape": [-1]}],
    "outputs": [{"name": "label", "datatype": "BYTES", "shape": [-1]}],
})  # fmt: skip


def pixels(rows: int, **override: object) -> dict[str, object]:
    return {"name": "pixels", "datatype": "FP32", "shape": [rows, 64], "data": [0.5] * (64 * rows), **override}


def test_inputs_that_fit_become_typed_arrays_with_their_batch_size():
    arrays, batch = decode_inputs(DIGITS, [pixels(3)])
    assert batch == 3
    assert arrays["pixels"].dtype == np.float32
    assert arrays["pixels"].shape == (3, 64)
    nested = pixels(2, data=[[0.25] * 64, [0.75] * 64])  # row-major nesting is allowed
    assert decode_inputs(DIGITS, [nested])[0]["pixels"][1, 0] == pytest.approx(0.75)
    texts, batch = decode_inputs(TEXT, [
        {"name": "text", "datatype": "BYTES", "shape": [2], "data": ["good", "bad"]},
        {"name": "lang", "datatype": "BYTES", "shape": [2], "data": ["en", "en"]},
    ])  # fmt: skip
    assert batch == 2
    assert texts["text"].tolist() == ["good", "bad"]


@pytest.mark.parametrize(
    ("inputs", "tensor", "says"),
    [
        ([pixels(1, name="pixel")], "pixel", "no such input"),
        ([pixels(1, datatype="FP64")], "pixels", "the model takes FP32"),
        ([pixels(1, shape=[1, 63], data=[0.0] * 63)], "pixels", "the model takes [-1, 64]"),
        ([pixels(1, shape=[1, 8, 8])], "pixels", "the model takes [-1, 64]"),
        ([pixels(2, data=[0.0] * 64)], "pixels", "64 values for shape [2, 64], which holds 128"),
        ([pixels(1, data=["a"] * 64)], "pixels", "not FP32"),
        ([pixels(1, data=[None] * 64)], "pixels", "not FP32"),
        ([pixels(1, data=[True] * 64)], "pixels", "not FP32"),
        ([pixels(1, data="0.5")], "pixels", "data must be a list"),
        ([pixels(0, data=[])], "pixels", "at least 1"),
        ([pixels(1), pixels(1)], "pixels", "given twice"),
        ([], "inputs", "non-empty list"),
    ],
)
def test_an_input_that_does_not_fit_is_refused_by_name(inputs, tensor, says):
    with pytest.raises(BadTensor) as refused:
        decode_inputs(DIGITS, inputs)
    assert refused.value.tensor == tensor
    assert says in str(refused.value)


def test_every_input_is_needed_and_they_share_a_batch_size():
    text = {"name": "text", "datatype": "BYTES", "shape": [2], "data": ["a", "b"]}
    with pytest.raises(BadTensor, match="'lang': missing"):
        decode_inputs(TEXT, [text])
    with pytest.raises(BadTensor, match="batch size is 1, another input's is 2"):
        decode_inputs(TEXT, [text, {"name": "lang", "datatype": "BYTES", "shape": [1], "data": ["en"]}])
    with pytest.raises(BadTensor, match="BYTES values are strings"):
        decode_inputs(TEXT, [text, {"name": "lang", "datatype": "BYTES", "shape": [2], "data": [1, 2]}])


def test_outputs_are_encoded_flat_in_signature_order():
    out = encode_outputs(DIGITS, {
        "label": np.array([3, 7]), "probabilities": np.full((2, 10), 0.1, dtype=np.float64),
    })  # fmt: skip
    assert [t["name"] for t in out] == ["probabilities", "label"]
    assert out[0]["shape"] == [2, 10]
    assert len(out[0]["data"]) == 20
    assert out[1] == {"name": "label", "datatype": "INT64", "shape": [2], "data": [3, 7]}


@pytest.mark.parametrize(
    ("signature", "field"),
    [
        ("x", "signature"),
        ({"inputs": [], "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1]}]}, "signature.inputs"),
        ({"inputs": [{"name": "x", "datatype": "FLOAT", "shape": [-1]}]}, "signature.inputs[0].datatype"),
        ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [0]}]}, "signature.inputs[0].shape"),
        ({"inputs": [{"name": "", "datatype": "FP32", "shape": [-1]}]}, "signature.inputs[0].name"),
        ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [-1]}] * 2}, "signature.inputs[1].name"),
        ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [-1]}]}, "signature.outputs"),
    ],
)
def test_a_bad_signature_names_its_entry(signature, field):
    with pytest.raises(InvalidInput) as refused:
        Signature.from_json(signature)
    assert refused.value.field == field


def test_the_signature_round_trips():
    assert Signature.from_json(DIGITS.as_json()) == DIGITS


class TestBinaryExtension:
    def test_a_binary_request_reads_back_as_the_same_arrays(self):
        from serving.gateway.inference_protocol import encode_request, read_body

        pixels = np.arange(128, dtype=np.float32).reshape(2, 64)
        body, length = encode_request({"pixels": pixels}, DIGITS)
        request = read_body(body, str(length))
        arrays, batch = decode_inputs(DIGITS, request["inputs"])
        assert batch == 2
        np.testing.assert_array_equal(arrays["pixels"], pixels)

    def test_bytes_tensors_and_their_lengths(self):
        from serving.gateway.inference_protocol import RAW, to_raw

        raw = to_raw(np.array(["good", "très bien"], dtype=object), "BYTES")
        lang = to_raw(np.array(["en", "fr"], dtype=object), "BYTES")
        arrays, _ = decode_inputs(TEXT, [
            {"name": "text", "datatype": "BYTES", "shape": [2], RAW: raw},
            {"name": "lang", "datatype": "BYTES", "shape": [2], RAW: lang},
        ])  # fmt: skip
        assert arrays["text"].tolist() == [b"good", "très bien".encode()]
        with pytest.raises(BadTensor, match="cut short"):
            decode_inputs(TEXT, [{"name": "text", "datatype": "BYTES", "shape": [2], RAW: raw[:-3]},
                                 {"name": "lang", "datatype": "BYTES", "shape": [2], RAW: lang}])  # fmt: skip

    def test_announced_bytes_must_be_there_and_nothing_more(self):
        from serving.gateway.inference_protocol import BadRequest, read_body

        header = (
            b'{"inputs":[{"name":"pixels","datatype":"FP32","shape":[1,64],"parameters":{"binary_data_size":256}}]}'
        )
        with pytest.raises(BadTensor, match="256 binary bytes announced"):
            read_body(header + b"\0" * 100, str(len(header)))
        with pytest.raises(BadRequest, match="no tensor announced"):
            read_body(header + b"\0" * 300, str(len(header)))
        with pytest.raises(BadRequest, match="Inference-Header-Content-Length"):
            read_body(header, "lots")
        wrong_size = (
            b'{"inputs":[{"name":"pixels","datatype":"FP32","shape":[1,64],"parameters":{"binary_data_size":8}}]}'
        )
        request = read_body(wrong_size + b"\0" * 8, str(len(wrong_size)))
        with pytest.raises(BadTensor, match="8 binary bytes for shape"):
            decode_inputs(DIGITS, request["inputs"])

    def test_outputs_in_json_or_binary_as_asked(self):
        from serving.gateway.inference_protocol import decode_outputs, encode_response, read_body, requested_outputs

        outputs = {"probabilities": np.full((2, 10), 0.1, dtype=np.float32), "label": np.array([3, 4])}
        assert requested_outputs(DIGITS, {}) == {"probabilities": False, "label": False}
        assert requested_outputs(DIGITS, {"parameters": {"binary_data_output": True}}) == {
            "probabilities": True, "label": True,
        }  # fmt: skip
        wanted = requested_outputs(DIGITS, {"outputs": [{"name": "label", "parameters": {"binary_data": True}}]})
        assert wanted == {"label": True}
        with pytest.raises(BadTensor, match="no such output"):
            requested_outputs(DIGITS, {"outputs": [{"name": "logits"}]})
        body, length = encode_response(DIGITS, outputs, {"label": True, "probabilities": False},
                                       model_name="d", model_version="1")  # fmt: skip
        assert length is not None
        back = decode_outputs(DIGITS, read_body(body, str(length)))
        assert back["label"].tolist() == [3, 4]
        np.testing.assert_allclose(back["probabilities"], outputs["probabilities"])


class TestSeedShapes:
    def test_instances_become_tensors(self):
        from serving.gateway.inference_protocol import instances_to_tensors

        tensors = instances_to_tensors(DIGITS, [{"pixels": [1.0] * 64}, [2.0] * 64])
        arrays, batch = decode_inputs(DIGITS, tensors)
        assert batch == 2
        assert arrays["pixels"][1, 0] == 2.0
        with pytest.raises(BadTensor, match="'image'"):
            instances_to_tensors(DIGITS, [{"image": [1.0] * 64}])
        with pytest.raises(BadTensor, match="missing from instance 0"):
            instances_to_tensors(TEXT, [{"text": "hi"}])

    def test_predictions_name_the_class(self):
        from serving.gateway.inference_protocol import predictions

        outputs = {"label": np.array([1, 0]), "probabilities": np.array([[0.2, 0.8], [0.9, 0.1]], dtype=np.float32)}
        answers = predictions(outputs, ["negative", "positive"], 2)
        assert [a["prediction"] for a in answers] == ["positive", "negative"]
        assert answers[0]["confidence"] == pytest.approx(0.8)
        assert answers[1]["outputs"]["label"] == 0


def test_agreement_compares_labels_item_by_item():
    from serving.shadow.traffic import agreement, predicted_labels

    primary = predicted_labels({"label": np.array([1, 2, 3]), "probabilities": np.zeros((3, 4))})
    assert agreement(primary, {"label": np.array([1, 0, 3])}) == (3, 2)
    # Without a label output, the argmax of the first output is the prediction.
    scores = np.array([[0.1, 0.9, 0, 0], [0, 0, 0.8, 0.2], [0.5, 0, 0, 0.1]])
    assert agreement(primary, {"scores": scores}) == (3, 2)
    assert agreement(primary, {"label": np.array([1, 2])}) == (3, 0)  # an answer of another size agrees on nothing


def test_several_requests_pack_into_one_body_and_back():
    parts = [Part(0, "12", b"x" * 20), Part(0, None, b"{}"), Part(429, None, b"")]
    assert unpack_many(pack_many(parts)) == parts
    assert unpack_many(pack_many([])) == []


def test_answers_stream_as_frames_in_any_order():
    answers = {2: Part(200, "5", b"hello world"), 0: Part(429, None, b'{"error": {}}'), 1: Part(200, None, b"")}
    body = b"".join(answer_frame(i, part) for i, part in answers.items())
    assert unpack_answers(body, 3) == answers
    with pytest.raises(BadRequest):
        unpack_answers(body, 2)  # an answer to a part that was not sent
    with pytest.raises(BadRequest):
        unpack_answers(body[:-3], 3)  # cut short
    with pytest.raises(BadRequest):
        frame_head(b"[0, 200, 12, 1]", 1)  # a header length that is not a string


@pytest.mark.parametrize(
    "body",
    [
        b"\x00\x00\x00\x03{1}",  # an index that is not JSON
        b"\x00\x00\x00\x0c[[0,null,5]]abc",  # a part longer than the body
        b"\x00\x00\x00\x0c[[0,null,1]]abc",  # bytes after the last part
        b"\x00\x00\x00\x07[[0,5]]",  # an entry of the wrong shape
        b"\x00\x00\x00\x0a[[0,12,1]]a",  # a header length that is not a string
    ],
)
def test_a_body_of_parts_that_does_not_add_up_is_refused(body):
    with pytest.raises(BadRequest):
        unpack_many(body)


# --- decoding is bounded by the declared shape (issue 34, defect 4) ---------------------------

ANY = Signature.from_json({
    "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, -1]}],
    "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1]}],
})  # fmt: skip
ONE_TEXT = Signature.from_json({
    "inputs": [{"name": "text", "datatype": "BYTES", "shape": [-1]}],
    "outputs": [{"name": "label", "datatype": "INT64", "shape": [-1]}],
})  # fmt: skip


class CountedBytes(bytes):
    """A binary part that counts how many times the decoder reads a piece of it."""

    reads = 0

    def __getitem__(self, key):
        type(self).reads += 1
        return super().__getitem__(key)


class CountedList(list[Any]):
    """JSON ``data`` that counts the values the decoder takes from it."""

    taken = 0

    def __iter__(self):
        for value in super().__iter__():
            type(self).taken += 1
            yield value


@pytest.fixture
def counted() -> None:
    CountedBytes.reads = 0
    CountedList.taken = 0


def bytes_elements(count: int, item: bytes = b"") -> bytes:
    return (len(item).to_bytes(4, "little") + item) * count


class TestBoundedDecoding:
    def test_a_million_bytes_elements_for_shape_1_are_not_all_read(self, counted):
        from serving.gateway.inference_protocol import RAW

        raw = CountedBytes(bytes_elements(1_000_000))
        with pytest.raises(BadTensor) as refused:
            decode_inputs(ONE_TEXT, [{"name": "text", "datatype": "BYTES", "shape": [1], RAW: raw}])
        # Each element is two reads (its length, its bytes): at most shape-count + 1 elements.
        assert CountedBytes.reads <= 2 * 2
        assert "more values than shape [1] holds" in str(refused.value)

    def test_a_million_json_values_for_shape_1_are_not_all_taken(self, counted):
        data = CountedList([""] * 1_000_000)
        with pytest.raises(BadTensor) as refused:
            decode_inputs(ONE_TEXT, [{"name": "text", "datatype": "BYTES", "shape": [1], "data": data}])
        assert CountedList.taken <= 2
        assert "more values than shape [1] holds" in str(refused.value)

    def test_nested_json_is_taken_no_further_than_the_shape_either(self, counted):
        rows = CountedList([CountedList([0.0] * 1000) for _ in range(1000)])
        with pytest.raises(BadTensor) as refused:
            decode_inputs(ANY, [{"name": "x", "datatype": "FP32", "shape": [1, 3], "data": rows}])
        assert CountedList.taken <= 3 + 2  # the outer list's first two rows, three values and one more
        assert "more values than shape [1, 3] holds" in str(refused.value)

    @pytest.mark.parametrize(
        ("datatype", "shape", "wire"),
        [
            ("BYTES", [2**40], "raw"),
            ("BYTES", [2**40], "json"),
            ("FP32", [2**40, 64], "raw"),
            ("FP32", [2**40, 64], "json"),
            ("FP32", [1, 2**40], "json"),
            ("FP32", [2**40, 0], "json"),  # no values at all, and 2**40 rows to bill
            ("FP32", [2**40, 0], "raw"),
            ("FP32", [2**70, 0], "json"),
        ],
    )
    def test_a_shape_no_body_can_hold_is_refused_before_its_data_is_read(self, counted, datatype, shape, wire):
        from serving.gateway.inference_protocol import RAW

        signature = ONE_TEXT if datatype == "BYTES" else ANY
        name = signature.inputs[0].name
        tensor: dict[object, object] = {"name": name, "datatype": datatype, "shape": shape}
        if wire == "raw":
            tensor[RAW] = CountedBytes(bytes_elements(3) if datatype == "BYTES" else b"\0" * 256)
        else:
            values: list[Any] = [""] * 3 if datatype == "BYTES" else [0.0] * 64
            tensor["data"] = CountedList(values)
        with pytest.raises(BadTensor) as refused:
            decode_inputs(signature, [tensor])
        assert (CountedBytes.reads, CountedList.taken) == (0, 0)
        assert "at most" in str(refused.value)

    def test_a_bytes_tensor_needs_four_bytes_an_element_before_any_is_read(self, counted):
        from serving.gateway.inference_protocol import RAW

        raw = CountedBytes(bytes_elements(3))
        with pytest.raises(BadTensor) as refused:
            decode_inputs(ONE_TEXT, [{"name": "text", "datatype": "BYTES", "shape": [1000], RAW: raw}])
        assert CountedBytes.reads == 0
        assert "12 binary bytes cannot hold 1000 BYTES values" in str(refused.value)

    def test_a_rank_beyond_any_model_is_refused(self):
        with pytest.raises(BadTensor) as refused:
            decode_inputs(ANY, [{"name": "x", "datatype": "FP32", "shape": [1] * 100_000, "data": [0.0]}])
        assert len(str(refused.value)) < 500  # the shape is not quoted back
        assert "dimensions" in str(refused.value)

    def test_what_fits_still_decodes(self):
        from serving.gateway.inference_protocol import RAW

        arrays, rows = decode_inputs(ONE_TEXT, [{"name": "text", "datatype": "BYTES", "shape": [3],
                                                 RAW: bytes_elements(3, b"hi")}])  # fmt: skip
        assert rows == 3
        assert arrays["text"].tolist() == [b"hi"] * 3


# --- a client's "_raw" is its own field, never the binary part's (issue 34, defect 7) -----------


class TestAClientsRawField:
    def test_it_is_an_unknown_field_not_a_binary_part(self):
        from serving.gateway.inference_protocol import read_body

        body = read_body(b'{"inputs":[{"name":"text","datatype":"BYTES","shape":[1],"_raw":"abcdefgh"}]}', None)
        with pytest.raises(BadTensor, match="data must be a list"):
            decode_inputs(ONE_TEXT, body["inputs"])
        body = read_body(
            b'{"inputs":[{"name":"text","datatype":"BYTES","shape":[1],"_raw":{"a":1},"data":["hi"]}]}', None
        )
        arrays, _ = decode_inputs(ONE_TEXT, body["inputs"])
        assert arrays["text"].tolist() == ["hi"]

    def test_with_a_binary_part_too_the_binary_part_is_read(self):
        from serving.gateway.inference_protocol import read_body

        header = (b'{"inputs":[{"name":"text","datatype":"BYTES","shape":[1],"_raw":"x",'
                  b'"parameters":{"binary_data_size":6}}]}')  # fmt: skip
        body = read_body(header + bytes_elements(1, b"hi"), str(len(header)))
        arrays, _ = decode_inputs(ONE_TEXT, body["inputs"])
        assert arrays["text"].tolist() == [b"hi"]

    def test_an_answer_with_a_raw_field_is_not_read_as_binary(self):
        from serving.gateway.inference_protocol import decode_outputs, read_body

        answer = read_body(b'{"outputs":[{"name":"label","datatype":"INT64","shape":[1],"_raw":"x","data":[3]}]}', None)
        assert decode_outputs(ONE_TEXT, answer)["label"].tolist() == [3]
