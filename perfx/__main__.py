from perfx.cli import main

raise SystemExit(main())
