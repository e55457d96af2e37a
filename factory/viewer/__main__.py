from factory.viewer.cli import main

raise SystemExit(main())
