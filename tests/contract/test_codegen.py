"""Models generated from the AsyncAPI document, the way an integrator in another language makes them.

The official AsyncAPI model generator (Modelina, npm) runs on the document the services produce
now (not the committed file, which test_contract already holds current), once per language; every
schema must come out as a named type, and the models must compile: TypeScript with `tsc --strict`,
Java with `javac`, Python with the byte compiler, Go with `gofmt` where it is installed."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shared.contract import ServiceAPI
from shared.tools.asyncapi import build_document, render_yaml

REPO = Path(__file__).resolve().parents[2]
MODELINA = REPO / "tests/contract/modelina"
LANGUAGES = ("typescript", "java", "go", "python")
TIMEOUT_S = 300  # generous: 2 cores shared with other work; generation takes ~5 s of CPU, each compile ~3 s
pytestmark = pytest.mark.timeout(2 * TIMEOUT_S)  # the module's generation runs in its first test's setup


def _need_modelina() -> None:
    if shutil.which("node") is None or not (MODELINA / "node_modules/@asyncapi/modelina").exists():
        pytest.skip("node and tests/contract/modelina/node_modules are needed (`make setup` installs them)")


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Modelina for every language from one parse of the document (the parse is most of the work);
    {language: summary} with `out` the model directory."""
    _need_modelina()
    root = tmp_path_factory.mktemp("codegen")
    doc = root / "asyncapi.yaml"
    doc.write_text(render_yaml(build_document()))
    r = subprocess.run(["node", str(MODELINA / "generate.mjs"), str(doc), ",".join(LANGUAGES), str(root)],
                       capture_output=True, text=True, timeout=TIMEOUT_S)
    assert r.returncode == 0, f"modelina failed\n{r.stdout}\n{r.stderr}"
    summaries = json.loads(r.stdout.strip().splitlines()[-1])["languages"]
    yield {lang: {**summaries[lang], "out": root / lang} for lang in LANGUAGES}


@pytest.mark.parametrize("language", LANGUAGES)
def test_every_generated_model_has_a_name(generated: dict[str, Any], language: str) -> None:
    summary = generated[language]
    assert summary["anonymous"] == [], f"{language}: anonymous models {summary['anonymous']}"
    names = set(summary["models"])
    mangled = sorted(n for n in names if n.startswith("Reserved"))  # Modelina's escape for keyword clashes
    assert mangled == [], f"{language}: names changed by the generator: {mangled}"
    # the types a client needs by name: payloads, reply unions and envelopes, the kit's messages
    assert {"EpuckSensors", "EpuckSetSpeed", "EpuckActuators", "ErrorReply", "ErrorInfo", "Status",
            "Health", "JobResult", "JobProgress"} <= names
    if language != "python":  # Modelina's Python renders unions inline (no class for X | Y)
        assert {"EpuckActuatorsOrError", "JobAcceptedOrError"} <= names
    assert "EpuckActuatorsOk" in names and "JobAcceptedOk" in names


def test_names_are_stable_and_come_from_models_and_fields() -> None:
    schemas = build_document()["components"]["schemas"]
    for name, schema in schemas.items():
        assert schema["title"] == name
    # an inline enum is named after its model and field, the nullable error of a job result too
    assert schemas["JobResult"]["properties"]["error"]["title"] == "JobResultError"
    assert schemas["EpuckActuatorsOrError"]["oneOf"] == [
        {"$ref": "#/components/schemas/EpuckActuatorsOk"}, {"$ref": "#/components/schemas/ErrorReply"}]
    # `int | None` is a nullable integer, not a nameless union
    assert schemas["Status"]["properties"]["pid"]["type"] == ["integer", "null"]
    assert render_yaml(build_document()) == render_yaml(build_document())


def test_an_inline_enum_gets_model_and_field_name() -> None:
    from typing import Literal

    from pydantic import BaseModel

    class ContractProbeRequest(BaseModel):
        mode: Literal["fast", "slow"]
        limit: Literal["low", "high"] | None = None

    api = ServiceAPI("contract-probe")
    api.command("probe", ContractProbeRequest, ContractProbeRequest)
    schemas = build_document([api])["components"]["schemas"]
    props = schemas["ContractProbeRequest"]["properties"]
    assert props["mode"]["title"] == "ContractProbeRequestMode"
    assert props["limit"]["title"] == "ContractProbeRequestLimit"  # enum | null stays a (named) union


def test_two_schemas_claiming_one_name_are_refused() -> None:
    from typing import Literal

    from pydantic import BaseModel

    # `ContractClash.foo_kind` and `ContractClashFoo.kind` both make ContractClashFooKind: the generator
    # must say so rather than emit one type for two different enums
    class ContractClash(BaseModel):
        foo_kind: Literal["a", "b"]

    class ContractClashFoo(BaseModel):
        kind: Literal["c", "d"]

    api = ServiceAPI("contract-clash")
    api.command("one", ContractClash, ContractClash)
    api.command("two", ContractClashFoo, ContractClashFoo)
    with pytest.raises(ValueError, match="ContractClashFooKind"):
        build_document([api])


def test_typescript_models_compile_with_tsc_strict(generated: dict[str, Any], tmp_path: Path) -> None:
    tsc = MODELINA / "node_modules/.bin/tsc"
    out = generated["typescript"]["out"]
    files = sorted(str(p) for p in out.glob("*.ts"))
    assert len(files) == len(generated["typescript"]["models"])
    r = subprocess.run([str(tsc), "--strict", "--noEmit", "--target", "es2022", "--module", "commonjs",
                        *files], capture_output=True, text=True, timeout=TIMEOUT_S)
    assert r.returncode == 0, r.stdout + r.stderr
    # the reply union is the two envelopes, and the error code is the closed set of the contract
    assert "EpuckActuatorsOk | ErrorReply" in (out / "EpuckActuatorsOrError.ts").read_text()
    assert '"invalid_request"' in (out / "ErrorCode.ts").read_text()


def test_java_models_compile_with_javac(generated: dict[str, Any], tmp_path: Path) -> None:
    javac = shutil.which("javac")
    if javac is None:
        pytest.skip("javac is not installed (Debian: default-jdk-headless)")
    files = sorted(str(p) for p in generated["java"]["out"].glob("*.java"))
    assert len(files) == len(generated["java"]["models"])
    r = subprocess.run([javac, "-d", str(tmp_path), *files], capture_output=True, text=True, timeout=TIMEOUT_S)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "robobus/models/EpuckSensors.class").exists()


def test_python_models_compile(generated: dict[str, Any]) -> None:
    files = sorted(str(p) for p in generated["python"]["out"].glob("*.py"))
    assert len(files) == len(generated["python"]["models"])
    r = subprocess.run([sys.executable, "-m", "py_compile", *files], capture_output=True, text=True,
                       timeout=TIMEOUT_S)
    assert r.returncode == 0, r.stdout + r.stderr


def test_go_models_parse_with_gofmt(generated: dict[str, Any]) -> None:
    gofmt = shutil.which("gofmt")
    if gofmt is None:
        pytest.skip("gofmt is not installed (Debian: golang-go); the Go models are still checked for names")
    files = sorted(str(p) for p in generated["go"]["out"].glob("*.go"))
    r = subprocess.run([gofmt, "-e", "-l", *files], capture_output=True, text=True, timeout=TIMEOUT_S)
    assert r.returncode == 0, r.stdout + r.stderr
