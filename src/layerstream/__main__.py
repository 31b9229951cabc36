from layerstream.cli.main import entry

entry()
