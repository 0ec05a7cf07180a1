"""What tests share: fixtures (live servers, stand-in devices and hubs, the tiny models), waiting on state
(`wait.wait_until`, never sleeps), and the tests' own references (sampling, the 26B config). Never imported by server/."""
