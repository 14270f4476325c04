"""Publishing a merge output folder (model, barrier.json, plot, card) to the Hugging Face Hub.

What is uploaded is a hard-linked copy of the folder in which the card is rendered for the repository's
name and barrier.json and eval.json show local paths by their names only; every text file of it is then searched
for a local absolute path (refused if one is found), all before the repo is created.  A repo the push created is
deleted again if the upload fails or is interrupted.  The folder itself is not touched until the upload
succeeded; then its card is replaced by the one that was published."""
from __future__ import annotations

import json
import re
import shlex
import tempfile
from pathlib import Path

from ..errors import UserError
from ..evaluation.report import read_report, report_text
from ..export.io import atomic_write, linked_copy
from ..export.ownership import MANIFEST, check_editable_dir, record_files
from .cards import public_command, public_value, render_card
from .recipes import RECIPE_COPY

EVAL_FILE = "eval.json"
TEXT_SUFFIXES = (".json", ".md", ".txt", ".jinja", ".yaml", ".yml")  # what is searched for local paths
MAX_SCANNED_BYTES = 64 * 2**20


def push_command(out_dir: Path, repo_id: str, *, exist_ok: bool, private: bool, revision: str | None,
                 commit_message: str | None) -> str:
    """The shell command that repeats a push (shown when one fails)."""
    words = ["hf-rebasin", "push", str(out_dir), repo_id] + (["--exist-ok"] if exist_ok else [])
    words += ["--private"] if private else []
    words += ["--revision", revision] if revision else []
    words += ["--commit-message", commit_message] if commit_message else []
    return shlex.join(words)


def one_line(error: Exception) -> str:
    return f"{type(error).__name__}: " + " ".join(str(error).split())  # HTTP errors span several lines


def hub_token(token: str | None = None) -> str:
    from huggingface_hub import get_token
    token = token or get_token()
    if not token:
        raise UserError("no Hugging Face token: set HF_TOKEN to a token with write access "
                        "(https://huggingface.co/settings/tokens) or run `hf auth login`")
    return token


def check_push_target(repo_id: str) -> None:
    """What can be checked before a merge that ends in a push: the repo id's form and a token."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id
    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise UserError(f"--push-to-hub {repo_id!r} is not a Hub repository id ({one_line(error)})") from error
    hub_token(None)


def publishable_report(out_dir: Path) -> str:
    """barrier.json as it is published: local paths by their names only."""
    report = read_report(out_dir)
    report.models = public_value(report.models)
    report.data = public_value(report.data)
    report.settings = public_value(report.settings)
    report.command = public_command(report.command)
    return report_text(report)


def publishable_eval(out_dir: Path, model_name: str) -> str:
    """eval.json as it is published: the merged model by the repo's name, its endpoints and the task folders by
    their names only (as the card names them)."""
    evaluation = json.loads((out_dir / EVAL_FILE).read_text())
    models = evaluation.get("models") or {}
    evaluation["models"] = {label: model_name if label == "merged" else public_value(source)
                            for label, source in models.items()}
    evaluation["settings"] = public_value(evaluation.get("settings") or {})
    return json.dumps(evaluation, indent=2) + "\n"


def publishable_recipe(out_dir: Path) -> str:
    """recipe.yaml (the recipe a `run` made the folder with) as it is published: local paths by their names."""
    import yaml
    text = (out_dir / RECIPE_COPY).read_text()
    header = []
    for line in text.splitlines():  # the comment lines on top: the command that ran it, the file it came from
        if not line.startswith("#"):
            break
        header.append("# " + public_command(line[1:].strip()))
    fields = public_value(yaml.safe_load(text) or {})
    return "\n".join(header) + ("\n" if header else "") + yaml.safe_dump(fields, sort_keys=False,
                                                                         allow_unicode=True)


def local_roots(out_dir: Path, report) -> list[str]:
    """Absolute local places whose paths must not be published: the output, its parent and every local source
    model; the working, home and temporary folders when at least two levels deep (a vocabulary may well hold a
    token such as "/tmp" or "/root")."""
    specific = {out_dir.resolve(), out_dir.resolve().parent}
    specific |= {Path(m).expanduser().resolve() for m in report.models if Path(str(m)).expanduser().exists()}
    generic = {Path.cwd().resolve(), Path.home().resolve(), Path(tempfile.gettempdir()).resolve()}
    places = {p for p in specific if len(p.parts) >= 2} | {p for p in generic if len(p.parts) >= 3}
    return sorted({str(p) for p in places}, key=len, reverse=True)


def local_path_in(stage: Path, roots: list[str]) -> tuple[str, str] | None:
    """(file, local path) for the first text file of `stage` that names a local absolute path, else None."""
    pattern = re.compile("(?:" + "|".join(re.escape(root) for root in roots) + r")(?=[/\\\s\"'),:;]|$)")
    for path in sorted(stage.rglob("*")):
        if not path.is_file() or path.suffix not in TEXT_SUFFIXES or path.stat().st_size > MAX_SCANNED_BYTES:
            continue
        found = pattern.search(path.read_text(errors="replace"))
        if found:
            return path.relative_to(stage).as_posix(), found.group(0)
    return None


def create_repo(api, repo_id: str, *, private: bool, exist_ok: bool, first_try: str) -> bool:
    """Create repo_id; True when this call created it (False: it existed, and exist_ok)."""
    from huggingface_hub.errors import HfHubHTTPError
    try:
        api.create_repo(repo_id, private=private, exist_ok=False)
        return True
    except HfHubHTTPError as error:
        status = error.response.status_code if error.response is not None else None
        if exist_ok and status in (401, 402, 403, 409):  # it may exist: huggingface_hub's own exist_ok checks
            try:
                api.create_repo(repo_id, private=private, exist_ok=True)
                return False
            except HfHubHTTPError as again:
                error, status = again, again.response.status_code if again.response is not None else None
        if status == 409:
            raise UserError(f"the Hub repo {repo_id} already exists; pass --exist-ok to upload into it "
                            "(files of the same name are replaced in a new commit; history is kept)") from error
        if status in (401, 403):
            raise UserError(f"the Hub refused to create {repo_id} ({status}): the token is invalid or has no write "
                            "access to that namespace; set HF_TOKEN to a write token or run `hf auth login`") from error
        raise UserError(f"could not create the Hub repo {repo_id} ({one_line(error)}). "
                        f"Retry with: {first_try}") from error
    except Exception as error:  # network failures and the like: nothing was created or changed
        raise UserError(f"could not create the Hub repo {repo_id} ({one_line(error)}). "
                        f"Retry with: {first_try}") from error


def undo_creation(api, repo_id: str) -> bool:
    """Delete a repo this push created and could not fill; whether it is gone."""
    try:
        api.delete_repo(repo_id, missing_ok=True)
        return True
    except Exception:  # noqa: BLE001 - the caller says what was left
        return False


def push(out_dir: str | Path, repo_id: str, *, private: bool = False, revision: str | None = None,
         commit_message: str | None = None, exist_ok: bool = False, token: str | None = None) -> str:
    """Create repo_id on the Hub and upload the merge output folder to it; return the commit url.  Everything is
    checked and staged before the repo is created; a repo this push created is deleted if the upload fails."""
    from huggingface_hub import HfApi

    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        raise UserError(f"{out_dir} is not a folder: pass the output folder of `hf-rebasin merge`")
    report = read_report(out_dir)
    check_editable_dir(out_dir, "DIR")  # staged beside it; its card is replaced after the upload
    token = hub_token(token)
    model_name = repo_id.split("/")[-1]
    api = HfApi(token=token)  # endpoint from HF_ENDPOINT (huggingface_hub.constants.ENDPOINT)
    options = dict(private=private, revision=revision, commit_message=commit_message)
    first_try = push_command(out_dir, repo_id, exist_ok=exist_ok, **options)
    retry = push_command(out_dir, repo_id, exist_ok=True, **options)

    card = str(render_card(out_dir, model_name=model_name))
    with linked_copy(out_dir, "push") as stage:
        (stage / MANIFEST).unlink(missing_ok=True)  # the folder's own record, not part of the model
        atomic_write(stage / "README.md", card)
        atomic_write(stage / "barrier.json", publishable_report(out_dir))
        if (out_dir / EVAL_FILE).is_file():
            atomic_write(stage / EVAL_FILE, publishable_eval(out_dir, model_name))
        if (out_dir / RECIPE_COPY).is_file():
            atomic_write(stage / RECIPE_COPY, publishable_recipe(out_dir))
        leak = local_path_in(stage, local_roots(out_dir, report))
        if leak:
            raise UserError(f"{out_dir}/{leak[0]} names the local path {leak[1]}, which would be published: remove "
                            "it from the file (hf-rebasin publishes local paths by their names only)")
        created = create_repo(api, repo_id, private=private, exist_ok=exist_ok, first_try=first_try)
        try:
            if revision and revision != "main":
                api.create_branch(repo_id, branch=revision, exist_ok=True)
            info = api.upload_folder(
                repo_id=repo_id, folder_path=stage, revision=revision,
                ignore_patterns=[".*.tmp"],  # a temp file left by a killed write
                commit_message=commit_message or f"hf-rebasin merge ({report.method}) of "
                                                 + ", ".join(public_value(report.models)))
        except BaseException as error:  # any upload failure (HTTP, network, disk, Ctrl-C) gets the retry command
            gone = created and undo_creation(api, repo_id)
            left = (f"the repo {repo_id} it had created was deleted; retry with: {first_try}" if gone else
                    f"the repo {repo_id} was left as it was{' (created, empty)' if created else ''}; retry with: "
                    f"{retry}")
            if isinstance(error, KeyboardInterrupt):
                if gone or not created:
                    raise
                raise UserError(f"push interrupted: {out_dir} is unchanged, {left}") from error
            raise UserError(f"upload of {out_dir} to {repo_id} failed ({one_line(error)}). "
                            f"{out_dir} is unchanged; {left}") from error
    atomic_write(out_dir / "README.md", card)  # the folder's card is now the published one
    record_files(out_dir, ["README.md"])
    return info.commit_url
