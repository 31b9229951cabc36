from layerstream.cli.main import main

raise SystemExit(main())
