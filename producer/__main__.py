from producer.cli import main

raise SystemExit(main())
