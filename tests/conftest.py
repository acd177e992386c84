pytest_plugins = ["shared.testing"]
