"""`robobus foxglove`: the live bus as a Foxglove WebSocket server (bridge.py), the camera as
foxglove.CompressedImage (images.py), the command line (cli.py). docs/foxglove.md is the user's guide."""
