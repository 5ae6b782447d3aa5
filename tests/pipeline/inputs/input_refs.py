"""Small builders the inputs tests share: a PDF reference and a job over given inputs."""

from pathlib import Path

from pipeline.inputs.discover import DocumentRef
from pipeline.inputs.job_file import load_job


def pdf_ref(path: Path) -> DocumentRef:
    return DocumentRef(source=path, kind="pdf", doc_id=path.name)


def job_in(d: Path, inputs: str):
    (d / "job.yaml").write_text(f"name: t\ninputs: {inputs}\ntasks: [{{name: a, prompt: hi}}]\noutput: o.jsonl\n")
    return load_job(d / "job.yaml")
