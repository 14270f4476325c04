"""Publishing a merge output folder (model, barrier.json, plot, card) to the Hugging Face Hub.

What is uploaded is a hard-linked copy of the folder in which the card is rendered for the repository's
name and barrier.json shows local paths by their names only (never an absolute path).  The folder itself
is not touched until the upload succeeded; then its card is replaced by the one that was published."""
from __future__ import annotations

import shlex
from pathlib import Path

from ..errors import UserError
from ..evaluation.report import read_report, report_text
from ..export.io import atomic_write, linked_copy
from .cards import public_command, public_value, render_card


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


def push(out_dir: str | Path, repo_id: str, *, private: bool = False, revision: str | None = None,
         commit_message: str | None = None, exist_ok: bool = False, token: str | None = None) -> str:
    """Create repo_id on the Hub and upload the merge output folder to it; return the commit url."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        raise UserError(f"{out_dir} is not a folder: pass the output folder of `hf-rebasin merge`")
    report = read_report(out_dir)
    token = hub_token(token)
    model_name = repo_id.split("/")[-1]
    api = HfApi(token=token)  # endpoint from HF_ENDPOINT (huggingface_hub.constants.ENDPOINT)
    options = dict(private=private, revision=revision, commit_message=commit_message)
    first_try = push_command(out_dir, repo_id, exist_ok=exist_ok, **options)
    retry = push_command(out_dir, repo_id, exist_ok=True, **options)  # the repo exists once create_repo succeeded

    try:
        api.create_repo(repo_id, private=private, exist_ok=exist_ok)
    except HfHubHTTPError as error:
        status = error.response.status_code if error.response is not None else None
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

    card = str(render_card(out_dir, model_name=model_name))
    with linked_copy(out_dir, "push") as stage:
        atomic_write(stage / "README.md", card)
        atomic_write(stage / "barrier.json", publishable_report(out_dir))
        try:
            if revision and revision != "main":
                api.create_branch(repo_id, branch=revision, exist_ok=True)
            info = api.upload_folder(
                repo_id=repo_id, folder_path=stage, revision=revision,
                ignore_patterns=[".*.tmp"],  # a temp file left by a killed write
                commit_message=commit_message or f"hf-rebasin merge ({report.method}) of "
                                                 + ", ".join(public_value(report.models)))
        except Exception as error:  # any upload failure (HTTP, network, disk) gets the retry command
            raise UserError(f"upload of {out_dir} to {repo_id} failed ({one_line(error)}). "
                            f"{out_dir} is unchanged; retry with: {retry}") from error
    atomic_write(out_dir / "README.md", card)  # the folder's card is now the published one
    return info.commit_url
