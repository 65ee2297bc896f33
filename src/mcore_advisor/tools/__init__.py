"""The tool functions the MCP server and the CLI expose (names and import paths promised to users); the work is done in physics/, planning/, diagnosis/ and rendering/."""
