from layerstream.cli.interrupt import command_entry

command_entry()
