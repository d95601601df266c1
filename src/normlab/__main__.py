from normlab.cli import main

raise SystemExit(main())
