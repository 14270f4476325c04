"""``hf-rebasin push``: upload a merge output folder (model, barrier.json, plot, card) to the Hugging Face Hub."""
from __future__ import annotations

import shlex
from pathlib import Path

from .cli import UserError


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


def hub_token(token: str | None) -> str:
    from huggingface_hub import get_token
    token = token or get_token()
    if not token:
        raise UserError("no Hugging Face token: set HF_TOKEN to a token with write access "
                        "(https://huggingface.co/settings/tokens) or run `hf auth login`")
    return token


def push(out_dir: str | Path, repo_id: str, *, private: bool = False, revision: str | None = None,
         commit_message: str | None = None, exist_ok: bool = False, token: str | None = None) -> str:
    """Create repo_id on the Hub and upload the merge output folder to it; return the commit url."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    from .cards import read_barrier, write_card

    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        raise UserError(f"{out_dir} is not a folder: pass the output folder of `hf-rebasin merge`")
    barrier = read_barrier(out_dir)
    token = hub_token(token)
    write_card(out_dir, model_name=repo_id.split("/")[-1])
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
    except Exception as error:  # noqa: BLE001 - network failures and the like: nothing was created or changed
        raise UserError(f"could not create the Hub repo {repo_id} ({one_line(error)}). "
                        f"Retry with: {first_try}") from error

    try:
        if revision and revision != "main":
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        info = api.upload_folder(
            repo_id=repo_id, folder_path=out_dir, revision=revision,
            ignore_patterns=[".*.tmp"],  # a temp file left by a killed write_card
            commit_message=commit_message or f"hf-rebasin merge ({barrier['method']}) of "
                                             + ", ".join(map(str, barrier["models"])),
        )
    except Exception as error:  # noqa: BLE001 - any upload failure (HTTP, network, disk) gets the retry command
        raise UserError(f"upload of {out_dir} to {repo_id} failed ({one_line(error)}). "
                        f"{out_dir} is unchanged; retry with: {retry}") from error
    return info.commit_url


def run_push(args) -> int:
    url = push(args.dir, args.repo_id, private=args.private, revision=args.revision,
               commit_message=args.commit_message, exist_ok=args.exist_ok)
    print(url)
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "push", help="upload a merge output folder to the Hugging Face Hub",
        description="Upload the output folder of `hf-rebasin merge` (merged model, barrier.json, barrier.png and "
                    "a freshly rendered model card) to a new Hub repository. Needs HF_TOKEN or `hf auth login`.")
    parser.add_argument("dir", help="the merge output folder (holds barrier.json)")
    parser.add_argument("repo_id", help="the Hub repository to create, e.g. your-name/pythia-70m-merged")
    parser.add_argument("--private", action="store_true", help="create the repository as private")
    parser.add_argument("--revision", help="branch to upload to (created from main if missing)")
    parser.add_argument("--commit-message", help="message of the upload commit")
    parser.add_argument("--exist-ok", action="store_true",
                        help="upload into the repository if it already exists (otherwise that is an error)")
    parser.set_defaults(func=run_push)
