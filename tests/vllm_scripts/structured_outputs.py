"""Structured outputs: a choice, a regex and a JSON schema (from a Pydantic model)."""

import json
from enum import Enum

from pydantic import BaseModel, ConfigDict, Field

from memra import LLM, SamplingParams
from memra.sampling_params import StructuredOutputsParams


class CarType(str, Enum):
    sedan = "sedan"
    suv = "SUV"
    truck = "Truck"


class CarDescription(BaseModel):
    model_config = ConfigDict(extra="forbid")  # no properties beyond these three

    brand: str = Field(max_length=12)
    model: str = Field(max_length=12)
    car_type: CarType


def main():
    llm = LLM(model="demo", max_model_len=512)

    choice = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["Positive", "Negative"]))
    out = llm.generate("Classify this sentiment: memra is wonderful!", choice)[0].outputs[0].text
    print(f"choice: {out!r}")
    assert out in ("Positive", "Negative")

    regex = SamplingParams(structured_outputs=StructuredOutputsParams(regex=r"[a-z]{3,8}@[a-z]{3,6}\.com\n"),
                           stop=["\n"], max_tokens=40)
    out = llm.generate("Generate an email address for Alan Turing, who works in Enigma. End in .com:\n",
                       regex)[0].outputs[0].text
    print(f"regex: {out!r}")
    assert out.endswith(".com") and "@" in out

    schema = CarDescription.model_json_schema()
    json_params = SamplingParams(structured_outputs=StructuredOutputsParams(json=schema), temperature=0,
                                 max_tokens=100)
    out = llm.generate("Generate a JSON with the brand, model and car_type of the most iconic car from the 90's",
                       json_params)[0].outputs[0]
    print(f"json: {out.text!r} ({out.finish_reason})")
    car = CarDescription.model_validate(json.loads(out.text))
    print(f"parsed: {car!r}")


if __name__ == "__main__":
    main()
