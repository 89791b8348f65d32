from gpuscope.cli import main

raise SystemExit(main())
