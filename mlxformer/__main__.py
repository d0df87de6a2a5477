from mlxformer.cli.main import main

raise SystemExit(main())
