"""``bastion install-units``: the systemd units of scripts/ for this environment's ``bastion``.

The units in scripts/ run ``/usr/local/bin/bastion``, which nothing installs; this writes them
with ``ExecStart=`` naming the ``bastion`` beside this Python (the virtual environment's), plus
the example environment file when none exists yet (an edited one is never overwritten). The
service user needs no set-up: the units use ``DynamicUser=yes``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

logger = logging.getLogger("bastion.units")

UNIT_NAMES = ("bastion.service", "bastion@.service")
ENV_EXAMPLE = "bastion.env.example"
PLACEHOLDER_BINARY = "/usr/local/bin/bastion"
PLACEHOLDER_ENV_DIR = "/etc/bastion"
# Hidden from the service by ProtectHome=yes.
_HOME_DIRS = ("/home", "/root", "/run/user")


def add_install_units_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dest", default="/etc/systemd/system",
                        help="where the unit files go")
    parser.add_argument("--env-dir", default=PLACEHOLDER_ENV_DIR,
                        help="where bastion.env (EnvironmentFile=) lives")
    parser.add_argument("--bin", default=None,
                        help="the bastion executable (default: the one beside this Python)")


def units_folder() -> Path:
    """scripts/ of this checkout (the editable install scripts/setup.sh makes)."""
    return Path(__file__).resolve().parent.parent / "scripts"


def default_binary() -> Path:
    return Path(sys.executable).parent / "bastion"


def render_unit(text: str, binary: str, env_dir: str) -> str:
    """A unit of scripts/ with this environment's paths; a binary under a home folder gets
    ``ProtectHome=read-only`` (``yes`` would hide it from the service)."""
    text = text.replace(PLACEHOLDER_BINARY, binary).replace(PLACEHOLDER_ENV_DIR + "/",
                                                             env_dir.rstrip("/") + "/")
    if any(binary == d or binary.startswith(d + "/") for d in _HOME_DIRS):
        text = text.replace("\nProtectHome=yes\n", "\nProtectHome=read-only\n")
    return text


def unreadable_ancestors(path: Path) -> list[Path]:
    """Folders on the way to ``path`` that other users cannot enter (the dynamic service user
    is such an other user)."""
    return [p for p in path.parents if p.is_dir() and not os.stat(p).st_mode & 0o001]


def install_units(args: argparse.Namespace) -> list[Path]:
    """Write the units (and a first bastion.env); returns the files written."""
    from bastion.procs.args import UserError

    binary = Path(args.bin) if args.bin else default_binary()
    if not os.access(binary, os.X_OK):
        raise UserError(f"{binary} is not an executable bastion; install the project "
                        "(scripts/setup.sh) or pass --bin")
    binary = binary.absolute()
    if not (units_folder() / UNIT_NAMES[0]).is_file():
        raise UserError(f"no unit files in {units_folder()}: run install-units from a checkout "
                        "installed by scripts/setup.sh")
    dest, env_dir = Path(args.dest), Path(args.env_dir)
    written = []
    for name in UNIT_NAMES:
        text = render_unit((units_folder() / name).read_text(), str(binary), str(env_dir))
        dest.mkdir(parents=True, exist_ok=True)
        (dest / name).write_text(text)
        written.append(dest / name)
    env_file = env_dir / "bastion.env"
    if not env_file.exists():
        env_dir.mkdir(parents=True, exist_ok=True)
        env_file.write_text((units_folder() / ENV_EXAMPLE).read_text())
        env_file.chmod(0o640)
        written.append(env_file)
    for path in written:
        print(f"wrote {path}")
    if "ProtectHome=read-only" in (dest / UNIT_NAMES[0]).read_text():
        print(f"note: {binary} is under a home folder, so the units say ProtectHome=read-only")
    for folder in unreadable_ancestors(binary):
        print(f"warning: the service user cannot enter {folder} (mode "
              f"{os.stat(folder).st_mode & 0o777:o}); `chmod o+x {folder}` or move the venv",
              file=sys.stderr)
    print(f"next: edit {env_file}, then `systemctl daemon-reload && systemctl enable --now "
          "bastion` (or bastion@0 bastion@1 ... for one unit per data-parallel rank)")
    return written
