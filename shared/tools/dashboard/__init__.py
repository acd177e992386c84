"""The browser dashboard (`robobus dashboard`) and Home Assistant discovery (`robobus homeassistant`).

Both are driven by the AsyncAPI document, so a new service shows up in them without code of its own."""
