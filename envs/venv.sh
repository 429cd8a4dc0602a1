# shellcheck shell=bash
# Sourced by envs/*/setup.sh: the stamp that marks a finished install, and a fresh venv.
# A stamp file in the venv records the finished install spec; when it matches, the setup does
# nothing; a half-finished or different venv (no or another stamp) is rebuilt.

# venv_complete NAME VENV WANT: true (and says so) when VENV's stamp records WANT.
venv_complete() {
  local name=$1 venv=$2 want=$3
  if [[ -f "$venv/.eaglet-setup-complete" && "$(cat "$venv/.eaglet-setup-complete")" == "$want" ]]; then
    echo "envs/$name: already complete ($want) at $venv; nothing to do"
    return 0
  fi
  return 1
}

# venv_fresh NAME VENV PYTHON: VENV removed if present, then created with PYTHON, pip upgraded.
venv_fresh() {
  local name=$1 venv=$2 python=$3
  if [[ -d "$venv" ]]; then
    echo "envs/$name: removing incomplete or different venv at $venv"
    rm -rf "$venv"
  fi
  echo "envs/$name: creating venv with $($python --version) at $venv"
  "$python" -m venv "$venv"
  "$venv/bin/pip" install --quiet --upgrade pip
}

# venv_stamp VENV WANT: mark the install finished.
venv_stamp() {
  echo "$2" > "$1/.eaglet-setup-complete"
}
